"""What the installed distribution holds, and that none of its top-level names is taken.

A top-level package of ours named like a module of a dependency shadows it: transformers 5.25
depends on the Hugging Face `kernels` package and imports it on `import transformers.activations`,
which once found our kernels package there instead. The same goes for bench/'s scripts, whose
folder comes first on sys.path when one runs as `python bench/<name>.py`."""

import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.test_layers import PACKAGES

REPO = Path(__file__).resolve().parents[1]


def _names_of_other_distributions() -> dict[str, list[str]]:
    return {
        name: others
        for name, dists in importlib.metadata.packages_distributions().items()
        if (others := [d for d in dists if d.replace("_", "-").lower() != "pico-vllm"])
    }


def test_no_product_package_shares_a_name_with_an_installed_module():
    taken = _names_of_other_distributions()
    clashes = {name: taken[name] for name in PACKAGES if name in taken or name in sys.stdlib_module_names}
    assert not clashes, clashes


def test_no_bench_script_shadows_an_installed_module():
    taken = _names_of_other_distributions()
    scripts = [p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__"]
    clashes = [name for name in scripts if name in taken or name in sys.stdlib_module_names]
    assert not clashes, clashes


def test_transformers_imports_beside_our_packages():
    code = (
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
        "import pico_kernels\n"
        "assert hasattr(pico_kernels, 'select_ops')\n"
    )
    # A fresh interpreter with the repository first on the path, as an installed checkout has it.
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_bundled_model_ships_inside_the_package():
    spec = importlib.util.find_spec("model_svc")
    bundled = Path(spec.origin).parent / "bundled" / "stories260k"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (bundled / name).is_file(), name
