"""Where a scheduler-side process spends its interpreter lock, from py-spy's raw output
(`py-spy record --gil --threads -f raw`, as `bench/serve.py --py-spy DIR` records it).

    python bench/spy_breakdown.py DIR/scheduler-123.txt --tokens 133966 --steps 1616 --seconds 13.2

Each sample is one stack of the thread holding the GIL; it is put in the first category
whose pattern occurs in the stack (patterns in order, most specific first; `$` anchors a
pattern at the leaf, `^` at the root of a stack py-spy cut short), so the shares add up to
100 % of the process's Python time. With --tokens, --steps and --seconds it also
prints microseconds per output token and per engine step, and how busy the lock was.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

# (category, patterns): a stack matching any pattern belongs to the category.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    (
        "engine: detokenization (one batched decode per step)",
        ("IncrementalDetokenizer.step_batch", "Detokenizers.step"),
    ),
    ("engine: a RequestOutput per request per step", ("LLMEngine._output",)),
    ("engine: stop checks, appending tokens", ("LLMEngine._process_one", "LLMEngine._process")),
    ("engine: hand-off to the event loop (call_soon_threadsafe per output)", ("AsyncLLM._deliver",)),
    ("engine: step frame out (deltas, pickle, socket)", ("EngineCore._delta", "FrameChannel.send", "engine_stats")),
    ("engine: commands in (add, abort)", ("AsyncLLM._apply_commands", "EngineCore._apply", "FrameChannel.receive")),
    ("engine: scheduling and KV bookkeeping", ("Scheduler.schedule", "Scheduler.update", "KVClient.")),
    (
        "engine: model and KV calls (convert, send, wait)",
        ("ServiceEngine._launch", "_RemoteStep", "RemoteModel.", "LLMEngine._drain"),
    ),
    ("engine: rest of the step", ("ServiceEngine.step", "AsyncLLM._run", "EngineCore.run")),
    (
        "gRPC client threads (KV ApplyStep sender, model step stream)",
        ("_worker", "consume_request_iterator", "channel_spin", "_StepStream", "Thread.run"),
    ),
    (
        "loop: per-output wait machinery (a task, asyncio.wait and a timer per output)",
        ("SchedulerServicer._stream", "^wait", "^_wait"),
    ),
    ("loop: protobuf message per output", ("output_to_pb", "chunk_to_pb")),
    ("loop: metrics per message", ("StreamTimer.",)),
    ("loop: engine frames in (read, unpickle, merge)", ("EngineClient._read_loop", "OutputStream.put")),
    ("loop: waiting for output (queue, future)", ("OutputStream.take", "Queue.get", "AsyncLLM.generate")),
    ("loop: rest of the Generate handler", ("SchedulerServicer.Generate", "_wrap_stream")),
    ("loop: self-pipe wake-ups (call_soon_threadsafe)", ("_read_from_self",)),
    ("loop: epoll", ("EpollSelector.select",)),
    ("loop: gRPC aio and asyncio native code (send and receive per message, task steps)", ("Handle._run$",)),
    ("loop: rest of the event loop", ("BaseEventLoop",)),
]


def classify(stack: str) -> str:
    for name, patterns in CATEGORIES:
        for p in patterns:
            if p.startswith("^"):  # a stack py-spy cut short: its leaf alone
                if stack.startswith(p[1:]):
                    return name
            elif (p.endswith("$") and stack.endswith(p[:-1])) or (not p.endswith("$") and p in stack):
                return name
    return "other"


def load(path: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        frames = [re.sub(r" \(.*\)$", "", f) for f in stack.split(";")]
        counts[classify(";".join(frames[1:] if frames[0].startswith("thread") else frames))] += int(n)
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="py-spy raw files (several: summed)")
    p.add_argument("--rate", type=float, default=200.0, help="samples per second of the recording (default: 200)")
    p.add_argument("--tokens", type=int, default=0, help="output tokens of the recorded run")
    p.add_argument("--steps", type=int, default=0, help="engine steps of the recorded run")
    p.add_argument("--seconds", type=float, default=0.0, help="wall seconds of the recorded run")
    args = p.parse_args()
    counts: collections.Counter = collections.Counter()
    for f in args.files:
        counts += load(f)
    total = sum(counts.values())
    held = total / args.rate
    print(
        f"GIL held {held:.2f} s"
        + (f" of {args.seconds:.2f} s wall ({held / args.seconds:.0%})" if args.seconds else "")
    )
    print("\n| where | share | us/token | us/step |\n| --- | ---: | ---: | ---: |")
    for name, n in counts.most_common():
        per_token = f"{n / args.rate / args.tokens * 1e6:.2f}" if args.tokens else ""
        per_step = f"{n / args.rate / args.steps * 1e6:.0f}" if args.steps else ""
        print(f"| {name} | {n / total:.1%} | {per_token} | {per_step} |")


if __name__ == "__main__":
    main()
