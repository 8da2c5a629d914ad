"""The experiments the project reports (DESIGN.md): memory, block heatmap, load sweep, step profile.

    picovllm bench experiments [--out report] [--only memory|heatmap|load|steps] [--model ...] [--device ...]

Each experiment writes `<name>.json` and `<name>.png` into the output folder.
"""
