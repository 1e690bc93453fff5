"""``python -m lora info | inspect PATH``: kernel info, and an adapter file's summary (with an
``experts`` column when the adapter holds routed experts).

Exit status 0 on success, 2 on a bad file or argument, with a one-line error on stderr.
"""

import argparse
import os
import sys
import warnings

from . import _dtypes as dtypes


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):           # argparse prints usage + error; we want one line
        raise _UsageError(message)


def _parser():
    p = _Parser(prog="python -m lora", description="lora-kernels: kernel info and adapter files.")
    sub = p.add_subparsers(dest="command", metavar="{info,inspect}")
    sub.add_parser("info", help="print lora.kernel_info(), one key per line")
    ins = sub.add_parser("inspect", help="summarise a PEFT adapter directory or a llama.cpp GGUF")
    ins.add_argument("path", help="PEFT adapter directory / adapter_model.safetensors, or .gguf")
    ins.add_argument("--scale", type=float, default=1.0,
                     help="user scale (llama.cpp --lora-scaled), default 1")
    ins.add_argument("--dtype", choices=dtypes.NAMES, default=None,
                     help="storage dtype (default: the file's)")
    return p


def _info(out):
    import lora

    for key, value in lora.kernel_info().items():
        if isinstance(value, (list, tuple)):
            value = ", ".join(str(v) for v in value)
        elif isinstance(value, dict):  # the cpu: vendor AuthenticAMD, family 25, ...
            value = ", ".join(f"{k} {v}" for k, v in value.items())
        print(f"{key}: {value}", file=out)
    from ._vllm_plugin import status   # package metadata only: vLLM is not imported

    for key, value in status().items():
        print(f"{key}: {value}", file=out)


def _inspect(args, out):
    import lora
    from lora.gguf import is_gguf_file

    if not os.path.exists(args.path):
        raise FileNotFoundError(f"no such file or directory: {args.path}")
    fmt = "GGUF" if is_gguf_file(args.path) else "PEFT"
    load = lora.load_gguf if fmt == "GGUF" else lora.load_peft
    adapter = load(args.path, scale=args.scale, dtype=args.dtype)

    n_experts = {name: getattr(d, "n_experts", None) for name, d in adapter.items()}
    routed = sum(n is not None for n in n_experts.values())
    rows = [(name, f"{d.rows} x {d.cols}", str(d.rank), f"{d.alpha:g}", f"{d.effective_scale:g}",
             d.dtype, str(d.resident_bytes)) for name, d in adapter.items()]
    head = ("target", "rows x cols", "rank", "alpha", "eff.scale", "dtype", "bytes")
    left = (0, 5)
    if routed:  # routed experts (a mixture of experts' 3-D weights): their count, per target
        rows = [r[:1] + (str(n_experts[r[0]] or "-"),) + r[1:] for r in rows]
        head, left = head[:1] + ("experts",) + head[1:], (0, 6)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    alora = "" if adapter.invocation_tokens is None else \
        f", aLoRA invocation tokens {list(adapter.invocation_tokens)}"
    print(f"{adapter.name}: {fmt} LoRA adapter, {len(adapter)} targets, alpha {adapter.alpha:g}, "
          f"scale {adapter.scale.value:g}, dtype {adapter.dtype}{alora}", file=out)
    print(line(head), file=out)
    for r in rows:
        print(line(r), file=out)
    params = sum((n_experts[name] or 1) * d.rank * (d.rows + d.cols)
                 for name, d in adapter.items())
    of = f" ({routed} of them routed experts)" if routed else ""
    print(f"total: {len(adapter)} targets{of}, {params} parameters, {adapter.resident_bytes} "
          f"bytes ({adapter.resident_bytes / 2**20:.2f} MiB)", file=out)


def main(argv=None, out=None, err=None):
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = _parser().parse_args(argv)
        if args.command is None:
            raise _UsageError("a command is required: info or inspect PATH")
        # Warnings (skipped norm tensors, alpha 0) are shown only when the command succeeds, so
        # that a failure prints exactly one line.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.command == "info":
                _info(out)
            else:
                _inspect(args, out)
            out.flush()  # a reader gone away shows here, inside the handlers below
    except BrokenPipeError:  # the reader stopped reading (`... | head`): nothing to report
        if out is sys.stdout:
            try:  # flushing at exit would fail again: point stdout at /dev/null
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
        return 0
    except (_UsageError, ValueError, OSError) as exc:   # LoraFormatError is a ValueError
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"python -m lora: error: {text}", file=err)
        return 2
    for w in caught:
        print(f"warning: {' '.join(str(w.message).split())}", file=err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
