"""``python -m lora info | inspect PATH [--base MODEL]``: kernel info, and an adapter file's
summary (with an ``experts`` column when the adapter holds routed experts, and the magnitude
vectors of a DoRA adapter, with their norms when ``--base`` gives the base model's weights).

Exit status 0 on success, 2 on a bad file or argument, with a one-line error on stderr.
"""

import argparse
import os
import sys
import warnings

from . import _formats as formats


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
    ins.add_argument("--dtype", choices=formats.NAMES, default=None,
                     help="storage dtype (default: the file's)")
    ins.add_argument("--base", metavar="MODEL_DIR_OR_SAFETENSORS", default=None,
                     help="the base model's weights (a Hugging Face model directory, or one "
                          ".safetensors file): a DoRA adapter's norms are taken over them")
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


def _base_weights(path, modules):
    """``{module.weight: array}`` for the DoRA `modules`, read from a Hugging Face model
    directory (``model.safetensors``, or the shards ``model.safetensors.index.json`` names) or
    one ``.safetensors`` file; only those tensors are read.  A module's weight is
    ``<module>.weight`` (also under PEFT's ``base_model.model.`` / ``.base_layer`` names)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    p = Path(path)
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.is_file():
            with open(index, encoding="utf-8") as fh:
                files = [p / f for f in sorted(set(json.load(fh).get("weight_map", {}).values()))]
        else:
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ValueError(f"--base {path}: no .safetensors weights in this directory (a "
                             f"Hugging Face model directory holds model.safetensors)")
    else:
        files = [p]
    found = {}
    for f in files:
        try:
            with safe_open(os.fspath(f), framework="np") as fh:
                keys = set(fh.keys())
                for m in modules:
                    key = next((k for k in (f"{m}.weight", f"{m}.base_layer.weight",
                                            f"base_model.model.{m}.weight",
                                            f"base_model.model.{m}.base_layer.weight")
                                if k in keys), None)
                    if m not in found and key is not None:
                        found[m] = fh.get_tensor(key)
        except Exception as exc:  # SafetensorError, OSError: not a safetensors file
            raise ValueError(f"--base {f}: not a readable safetensors file: {exc}") from None
    missing = [m for m in modules if m not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"--base {path}: no weight for DoRA module '{missing[0]}'{more}: looked "
                         f"for '{missing[0]}.weight'")
    return {f"{m}.weight": w for m, w in found.items()}


def _span(values):
    """A vector in one cell: its smallest and largest value."""
    return f"{float(values.min()):.4g}..{float(values.max()):.4g}" if values.size else "-"


def _inspect(args, out):
    import lora
    from .loaders.gguf import is_gguf_file
    from .loaders.peft import inspect_peft

    if not os.path.exists(args.path):
        raise FileNotFoundError(f"no such file or directory: {args.path}")
    if args.base is not None and not os.path.exists(args.base):
        raise FileNotFoundError(f"--base: no such file or directory: {args.base}")
    fmt = "GGUF" if is_gguf_file(args.path) else "PEFT"
    magnitudes = {}
    if fmt == "GGUF":
        adapter = lora.load_gguf(args.path, scale=args.scale, dtype=args.dtype)
    else:
        adapter, magnitudes = inspect_peft(args.path, scale=args.scale, dtype=args.dtype)
        if args.base is not None and magnitudes:
            adapter, magnitudes = inspect_peft(args.path, scale=args.scale, dtype=args.dtype,
                                               base=_base_weights(args.base, list(magnitudes)))
    if args.base is not None and not magnitudes:
        warnings.warn(f"--base is not used: {args.path} is not a DoRA adapter (its deltas do "
                      f"not depend on the base)")
    norms = any(hasattr(d, "norm") for d in adapter.values())

    n_experts = {name: getattr(d, "n_experts", None) for name, d in adapter.items()}
    routed = sum(n is not None for n in n_experts.values())

    def size(name, d):  # a DoraDelta's bytes hold its magnitude (and statistics) already
        mag = magnitudes.get(name)
        return d.resident_bytes + (mag.nbytes if mag is not None and not norms else 0)

    rows = [(name, f"{d.rows} x {d.cols}", str(d.rank), f"{d.alpha:g}", f"{d.effective_scale:g}",
             d.dtype, str(size(name, d))) for name, d in adapter.items()]
    head = ("target", "rows x cols", "rank", "alpha", "eff.scale", "dtype", "bytes")
    left = (0, 5)
    if routed:  # routed experts (a mixture of experts' 3-D weights): their count, per target
        rows = [r[:1] + (str(n_experts[r[0]] or "-"),) + r[1:] for r in rows]
        head, left = head[:1] + ("experts",) + head[1:], (0, 6)
    if magnitudes:  # DoRA: the magnitude vector (its length and range), and the norms
        rows = [r + (f"[{magnitudes[r[0]].size}] {_span(magnitudes[r[0]])}",) for r in rows]
        head = head + ("magnitude",)
        if norms:
            rows = [r + (_span(adapter[r[0]].norm),) for r in rows]
            head = head + ("norm",)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    alora = "" if adapter.invocation_tokens is None else \
        f", aLoRA invocation tokens {list(adapter.invocation_tokens)}"
    kind = "DoRA" if magnitudes else "LoRA"
    dora = "" if not magnitudes else (
        f", norms over {args.base}" if norms else
        ", norms: pass --base MODEL_DIR_OR_SAFETENSORS")
    print(f"{adapter.name}: {fmt} {kind} adapter, {len(adapter)} targets, alpha "
          f"{adapter.alpha:g}, scale {adapter.scale.value:g}, dtype {adapter.dtype}{alora}{dora}",
          file=out)
    print(line(head), file=out)
    for r in rows:
        print(line(r), file=out)
    params = sum((n_experts[name] or 1) * d.rank * (d.rows + d.cols)
                 + (magnitudes[name].size if name in magnitudes else 0)
                 for name, d in adapter.items())
    total = adapter.resident_bytes + (0 if norms else sum(m.nbytes for m in magnitudes.values()))
    of = f" ({routed} of them routed experts)" if routed else ""
    print(f"total: {len(adapter)} targets{of}, {params} parameters, {total} "
          f"bytes ({total / 2**20:.2f} MiB)", file=out)


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
            from lora import _runtime

            for message in _runtime.take_warnings():  # import-time ones (LORA_ISA) under -m
                warnings.warn(message, RuntimeWarning)
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
