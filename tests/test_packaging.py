"""Our top-level `kernels` package must not be mistaken by transformers for the Hugging Face
`kernels` hub package of the same name (it checks for that name at import time)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_transformers_does_not_take_our_kernels_package_for_hub_kernels():
    code = (
        "import importlib.util, transformers\n"
        "from transformers.utils import import_utils\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "assert spec is not None and spec.origin.endswith('kernels/__init__.py'), spec\n"
        "assert not import_utils.is_kernels_available(), 'transformers thinks hub kernels are installed'\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))\n"
        "import kernels\n"
        "assert hasattr(kernels, 'select_ops')\n"
    )
    # A fresh interpreter with the repository first on the path, as an installed checkout has it.
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_bundled_model_ships_inside_the_package():
    spec = importlib.util.find_spec("model_svc")
    bundled = Path(spec.origin).parent / "bundled" / "stories260k"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (bundled / name).is_file(), name
