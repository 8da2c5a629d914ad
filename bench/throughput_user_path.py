"""bench/throughput.py's first rows: the path users take, `LLM(model=dir)` with every default
in a fresh process, over nano-vllm's workload (bench/throughput.py's make_workload and
timed_generate, imported in the child), with one of three tokenizers (bench/detok.py's):

- `qwen2`: the directory's own, the real Qwen2 tokenizer (every default);
- `none`: `skip_tokenizer_init=True`, the one setting changed (what detokenization costs);
- `bytes`: a byte-level tokenizer of 256 ids in the directory instead (the slow case: its
  decode of the model's ids gives no text, so each request's undecoded window grows);
- `fp8`: the directory's tokenizer and `kv_cache_dtype="fp8"` (half the K/V bytes a token).
"""

from __future__ import annotations

TOKENIZER_ROWS = {
    "qwen2": "defaults, Qwen2 tokenizer",
    "none": "skip_tokenizer_init=True, else defaults",
    "bytes": "defaults, a 256-id byte-level tokenizer",
    "fp8": 'kv_cache_dtype="fp8", else defaults, Qwen2 tokenizer',
}


def _user_path_main(model_dir: str, num_seqs: int, max_len: int, tokenizer: str, conn) -> None:
    """The child process of user_path_run."""
    from bench.throughput import make_workload, timed_generate
    from scheduler_svc.llm import LLM

    settings = {"none": {"skip_tokenizer_init": True}, "fp8": {"kv_cache_dtype": "fp8"}}.get(tokenizer, {})
    llm = LLM(model=model_dir, **settings)
    prompts, params = make_workload(num_seqs, max_len, max_len)
    conn.send(timed_generate(llm, prompts, params, llm.engine.model.device))
    conn.close()


def _with_byte_level_tokenizer(model_dir: str, scratch: str) -> str:
    """A directory of model_dir's config and weights (linked) with the byte-level tokenizer."""
    from pathlib import Path

    from bench.detok import byte_level_tokenizer

    for f in Path(model_dir).iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            Path(scratch, f.name).symlink_to(f.resolve())
    byte_level_tokenizer(scratch)
    return scratch


def user_path_run(model: str, num_seqs: int, max_len: int, tokenizer: str = "qwen2") -> tuple[float, int, int, int]:
    """The path users take, nano-vllm's protocol: in a fresh process, `LLM(model=dir)` with
    every default (the directory's tokenizer detokenizes every output token), one tiny warm-up
    generate, one timed generate of the workload. A named config (bench/common.py) gets a
    directory of random weights with the real Qwen2 tokenizer (bench/serve.py's prepare_model).
    tokenizer: a key of TOKENIZER_ROWS. Returns what timed_generate does: seconds, output
    tokens, steps, preemptions."""
    import shutil
    import tempfile

    from bench.common import in_fresh_process
    from bench.serve import prepare_model

    model_dir, tmp = prepare_model(model)
    scratch = tempfile.mkdtemp(prefix="picovllm-user-path-")
    if tokenizer == "bytes":
        model_dir = _with_byte_level_tokenizer(model_dir, scratch)
    try:
        return in_fresh_process("user-path run", _user_path_main, model_dir, num_seqs, max_len, tokenizer)
    finally:
        for path in (tmp, scratch):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)


def user_path_row(user: tuple[float, int, int, int], roof: float, tokenizer: str = "qwen2") -> str:
    seconds, num_out, steps, preemptions = user
    tok_s = num_out / seconds
    return (
        f"| user path: LLM(model=dir), {TOKENIZER_ROWS[tokenizer]}, fresh process | {num_out} | {seconds:.2f} "
        f"| {tok_s:,.0f} | {roof:,.0f} | {tok_s / roof:.1%} | {steps} | {preemptions} |"
    )
