"""bench/throughput.py's first row: the path users take, `LLM(model=dir)` with every default
in a fresh process, over nano-vllm's workload (bench/throughput.py's make_workload and
timed_generate, imported in the child)."""

from __future__ import annotations


def _user_path_main(model_dir: str, num_seqs: int, max_len: int, skip_tokenizer_init: bool, conn) -> None:
    """The child process of user_path_run."""
    from bench.throughput import make_workload, timed_generate
    from scheduler_svc.llm import LLM

    llm = LLM(model=model_dir, skip_tokenizer_init=True) if skip_tokenizer_init else LLM(model=model_dir)
    prompts, params = make_workload(num_seqs, max_len, max_len)
    conn.send(timed_generate(llm, prompts, params, llm.engine.model.device))
    conn.close()


def user_path_run(
    model: str, num_seqs: int, max_len: int, skip_tokenizer_init: bool = False
) -> tuple[float, int, int, int]:
    """The path users take, nano-vllm's protocol: in a fresh process, `LLM(model=dir)` with
    every default (the directory's tokenizer detokenizes every output token), one tiny warm-up
    generate, one timed generate of the workload. A named config (bench/common.py) gets a
    directory of random weights with the real Qwen2 tokenizer (bench/serve.py's prepare_model).
    skip_tokenizer_init: the one setting changed, for what detokenization costs on this path.
    Returns what timed_generate does: seconds, output tokens, steps, preemptions."""
    import multiprocessing as mp
    import shutil

    from bench.serve import prepare_model

    model_dir, tmp = prepare_model(model)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_user_path_main, args=(model_dir, num_seqs, max_len, skip_tokenizer_init, child))
    proc.start()
    child.close()
    try:
        return parent.recv()
    except EOFError:
        raise SystemExit(f"the user-path run failed (exit {proc.join() or proc.exitcode})") from None
    finally:
        proc.join()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def user_path_row(user: tuple[float, int, int, int], roof: float, skip_tokenizer_init: bool = False) -> str:
    seconds, num_out, steps, preemptions = user
    tok_s = num_out / seconds
    what = "skip_tokenizer_init=True, else defaults" if skip_tokenizer_init else "defaults, Qwen2 tokenizer"
    return (
        f"| user path: LLM(model=dir), {what}, fresh process | {num_out} | {seconds:.2f} "
        f"| {tok_s:,.0f} | {roof:,.0f} | {tok_s / roof:.1%} | {steps} | {preemptions} |"
    )
