"""Fuzzing the adapter loaders: mutated PEFT safetensors and llama.cpp GGUF files.

What must hold for every input (the "bad files" rules of docs/file-formats.md):

- the loader returns an adapter, or raises `lora.LoraFormatError` -- never any other exception
  (every path the fuzzer loads exists, so `FileNotFoundError`, the one other exception the
  loaders document, cannot be right here), a crash, a hang or a `MemoryError`;
- no allocation larger than the file justifies: the traced peak of one load stays under
  ``64 x file size + 32 MiB``, and outside the sanitizer build the loader runs under an address-space
  limit, so a GGUF declaring a terabyte tensor must be refused before anything is allocated;
- an adapter that loads is usable: each of its deltas is applied once.

Seeds are built here with ``safetensors.numpy.save`` and the tests' one GGUF writer
(``_adapter_files.write_gguf``, over ``gguf.GGUFWriter``: F32, F16, BF16, F64 and Q8_0 tensors,
embeddings, norm tensors, rank/alpha patterns), plus the upstream files in ``tests/fixtures``.
Mutations: truncation, bit flips, byte splices, integers written over the header's own fields
(counts, lengths, dims, types, offsets) with huge/negative/boundary values, safetensors header
edits (dtypes, shapes, offsets, renamed/deleted/duplicated names), GGUF duplicate names, and
adapter_config.json edits.

Every load runs in a worker subprocess (one per test module, restarted after a failure), so a
segfault or an abort fails the test that caused it instead of killing pytest; each load has a
timeout.  The run is bounded (``LORA_FUZZ_EXAMPLES`` examples per fuzz test, default 150);
``benchmarks/fuzz_long.py`` runs the same tests for much longer.  ``LORA_FUZZ_STATS=path``
appends one JSON line per load (the long run's counts come from there).
"""

import copy
import json
import os
import select
import struct
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import lora
from _adapter_files import peft_config, write_gguf

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

HAVE_LOADERS = hasattr(lora, "load_peft") and hasattr(lora, "load_gguf")
pytestmark = pytest.mark.skipif(
    not HAVE_LOADERS,
    reason="lora.load_peft / lora.load_gguf are not on this branch yet (the loaders branch); "
           "these tests run as soon as it is merged")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXAMPLES = int(os.environ.get("LORA_FUZZ_EXAMPLES", "150"))
LOAD_TIMEOUT = float(os.environ.get("LORA_FUZZ_TIMEOUT", "60"))
UNDER_ASAN = os.environ.get("LORA_UNDER_ASAN") == "1"
STATS = os.environ.get("LORA_FUZZ_STATS")
ALLOC_SLACK = 32 << 20
ALLOC_FACTOR = 64
AS_HEADROOM = 2 << 30  # address space the worker may grow by, outside ASan

# ------------------------------------------------------------------------------- the worker

_WORKER = textwrap.dedent(r"""
    import json, os, resource, sys, traceback, tracemalloc, warnings
    import numpy as np
    import lora

    warnings.simplefilter("ignore")
    headroom = int(sys.argv[1])

    def load(kind, path):
        ad = (lora.load_peft if kind == "peft" else lora.load_gguf)(path)
        n = 0
        for name, d in ad.items():   # a loaded adapter must be usable
            d.add_to(np.ones(d.cols, np.float32), np.zeros(d.rows, np.float32))
            d.add_rows_to([0, d.rows - 1], np.zeros((2, d.cols), np.float32))
            n += 1
        return n

    # warm up (imports, first-use caches) before measuring or limiting anything
    for kind, path in json.loads(sys.argv[2]):
        try:
            load(kind, path)
        except Exception:
            pass
    if headroom:
        with open("/proc/self/status") as fh:
            vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    tracemalloc.start(1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            res = {"outcome": "ok", "targets": load(req["kind"], req["path"])}
        except lora.LoraFormatError as exc:
            res = {"outcome": "format_error", "msg": str(exc)[:400]}
        except MemoryError as exc:
            res = {"outcome": "memory_error", "msg": repr(exc)[:400],
                   "tb": traceback.format_exc()[-3000:]}
        except Exception as exc:
            res = {"outcome": "other_error", "type": type(exc).__name__, "msg": str(exc)[:400],
                   "tb": traceback.format_exc()[-3000:]}
        res["peak"] = tracemalloc.get_traced_memory()[1] - base
        print(json.dumps(res), flush=True)
""")


class Worker:
    """A subprocess that loads files on request; a crash or hang is an outcome, not our death."""

    def __init__(self, warmup):
        self.warmup = warmup
        self.proc = None
        self.stderr = None

    def _start(self):
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(lora.__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [pkg_root, os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
        self.stderr = tempfile.TemporaryFile()
        headroom = 0 if UNDER_ASAN else AS_HEADROOM
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(headroom), json.dumps(self.warmup)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env=env)
        first = self._read(LOAD_TIMEOUT * 4)
        if first is None or not first.get("ready"):
            raise RuntimeError(f"fuzz worker did not start: {first} {self._stderr_tail()}")

    def _stderr_tail(self):
        self.stderr.seek(0)
        return self.stderr.read()[-4000:].decode("utf-8", "replace")

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"eof": True}

    def _stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def load(self, kind, path):
        if self.proc is None:
            self._start()
        self.proc.stdin.write(json.dumps({"kind": kind, "path": str(path)}) + "\n")
        self.proc.stdin.flush()
        res = self._read(LOAD_TIMEOUT)
        if res is None:
            self._stop()
            res = {"outcome": "hang", "msg": f"no answer within {LOAD_TIMEOUT} s"}
        elif res.get("eof"):
            rc = self.proc.wait()
            res = {"outcome": "crash", "msg": f"worker exited with {rc}",
                   "tb": self._stderr_tail()}
            self.proc = None
        if STATS:
            with open(STATS, "a") as fh:
                fh.write(json.dumps({"kind": kind, "outcome": res["outcome"],
                                     "type": res.get("type")}) + "\n")
        return res

    def close(self):
        self._stop()


def _file_bytes(kind, path):
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    return p.stat().st_size


def check_outcome(res, kind, path):
    """The contract for one load: an adapter, or LoraFormatError; a bounded allocation."""
    what = f"{kind} file {path}"
    assert res["outcome"] not in ("crash", "hang"), \
        f"{what}: {res['outcome']}: {res.get('msg')}\n{res.get('tb', '')}"
    assert res["outcome"] != "memory_error", \
        f"{what}: MemoryError -- an allocation the file does not justify\n{res.get('tb', '')}"
    limit = ALLOC_FACTOR * _file_bytes(kind, path) + ALLOC_SLACK
    assert res["peak"] <= limit, \
        f"{what}: a load allocated {res['peak']} bytes (traced) for a {_file_bytes(kind, path)}-byte file"
    assert res["outcome"] in ("ok", "format_error"), \
        f"{what}: want an adapter or LoraFormatError, got {res['outcome']} {res.get('type')}: " \
        f"{res.get('msg')}\n{res.get('tb', '')}"


def check_refused(res, kind, path):
    """`check_outcome`, and the file must be refused (LoraFormatError)."""
    check_outcome(res, kind, path)
    assert res["outcome"] == "format_error", f"{kind} file {path}: loaded, want LoraFormatError"


# -------------------------------------------------------------------------------- the seeds

# Safetensors dtype names, the valid ones first
ST_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64",
             "BOOL", "F8_E4M3", "F8_E5M2", "E8M0", "F4", "XX", ""]
HUGE = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63,
        2**64 - 1, 2**64]
INTERESTING = [0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 255, 256, 65535, 65536] + HUGE


@dataclass(repr=False)
class Seed:
    name: str
    kind: str                   # "peft" | "gguf"
    data: bytes                 # the weights file (safetensors or GGUF)
    config: bytes = b""         # adapter_config.json (PEFT)
    fields: list = field(default_factory=list)  # (offset, width, label) of header integers
    header_end: int = 0         # bytes before the tensor data
    names: list = field(default_factory=list)   # GGUF: (offset, length) of each string

    def __repr__(self):
        return f"<seed {self.name}: {len(self.data)} bytes>"

    def _repr_pretty_(self, p, cycle):  # hypothesis' printer would list every field
        p.text(repr(self))


class Case:
    """One mutated input; its repr (what hypothesis prints for a failure) is the mutation log."""

    def __init__(self, seed, data, config=b"", log=()):
        self.seed, self.data, self.config, self.log = seed, data, config, list(log)

    def __repr__(self):
        return f"Case({self.seed.name}, {len(self.data)} bytes, mutations={self.log})"


def _peft_config(r, alpha, targets, **extra):
    return json.dumps(peft_config(r=r, lora_alpha=alpha, target_modules=targets, **extra),
                      indent=2).encode()


def _safetensors_bytes(tensors):
    from safetensors.numpy import save

    return save(tensors)


def _st_seed(name, data, config):
    (n,) = struct.unpack_from("<Q", data, 0)
    return Seed(name, "peft", data, config, fields=[(0, 8, "header_len")], header_end=8 + n)


def build_peft_seeds():
    import ml_dtypes

    rng = np.random.default_rng(0)
    p = "base_model.model.model.layers.0."
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    tensors = {
        p + "self_attn.q_proj.lora_A.weight": f32(4, 16),
        p + "self_attn.q_proj.lora_B.weight": f32(24, 4),
        p + "self_attn.v_proj.lora_A.weight": f32(2, 16).astype(np.float16),
        p + "self_attn.v_proj.lora_B.weight": f32(8, 2).astype(np.float16),
        p + "mlp.down_proj.lora_A.weight": f32(4, 40).astype(ml_dtypes.bfloat16),
        p + "mlp.down_proj.lora_B.weight": f32(16, 4).astype(ml_dtypes.bfloat16),
        "base_model.model.model.embed_tokens.lora_embedding_A": f32(4, 32),
        "base_model.model.model.embed_tokens.lora_embedding_B": f32(16, 4),
        "base_model.model.model.embed_tokens.base_layer.weight": f32(32, 16),
    }
    small = _safetensors_bytes(tensors)
    cfg = _peft_config(4, 8, ["q_proj", "v_proj", "down_proj", "embed_tokens"],
                       rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 2.0},
                       use_rslora=True)
    f64 = _safetensors_bytes({
        "model.layers.1.mlp.up_proj.lora_A.default.weight": rng.standard_normal((3, 9)),
        "model.layers.1.mlp.up_proj.lora_B.default.weight": rng.standard_normal((5, 3)),
    })
    cfg64 = _peft_config(3, 0, "all-linear")
    fixture = FIXTURES / "peft_r8_alpha16"
    return [
        _st_seed("peft-small-mixed-dtypes", small, cfg),
        _st_seed("peft-f64-adapter-infix", f64, cfg64),
        _st_seed("peft-fixture", (fixture / "adapter_model.safetensors").read_bytes(),
                 (fixture / "adapter_config.json").read_bytes()),
    ]


def gguf_layout(buf):
    """Integer fields and strings of a GGUF v2/v3 header: [(offset, width, label)], [(off, len)],
    and the end of the tensor infos.  Written for valid seeds only."""
    fields, names = [], []
    o = 4
    fields.append((o, 4, "version"))
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    fields += [(8, 8, "n_tensors"), (16, 8, "n_kv")]
    o = 24
    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(o, label):
        (n,) = struct.unpack_from("<Q", buf, o)
        fields.append((o, 8, label + ".len"))
        names.append((o + 8, n))
        return o + 8 + n

    def value(o, vtype, label):
        if vtype == 8:
            return string(o, label)
        if vtype == 9:
            (itype,) = struct.unpack_from("<I", buf, o)
            (count,) = struct.unpack_from("<Q", buf, o + 4)
            fields.extend([(o, 4, label + ".array_type"), (o + 4, 8, label + ".array_count")])
            o += 12
            for _ in range(count):
                o = value(o, itype, label + "[]")
            return o
        return o + scalar[vtype]

    for _ in range(n_kv):
        o = string(o, "kv.key")
        (vtype,) = struct.unpack_from("<I", buf, o)
        fields.append((o, 4, "kv.type"))
        o = value(o + 4, vtype, "kv.value")
    for _ in range(n_tensors):
        o = string(o, "tensor.name")
        (n_dims,) = struct.unpack_from("<I", buf, o)
        fields.append((o, 4, "tensor.n_dims"))
        o += 4
        for d in range(n_dims):
            fields.append((o, 8, f"tensor.ne[{d}]"))
            o += 8
        fields += [(o, 4, "tensor.type"), (o + 4, 8, "tensor.offset")]
        o += 12
    return fields, names, o


SEED_NAME = "fuzz-seed"  # general.name of the GGUF files written here


def _gguf_seed(name, data):
    fields, names, end = gguf_layout(data)
    return Seed(name, "gguf", data, fields=fields, header_end=end, names=names)


def build_gguf_seeds(tmp):
    import gguf

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(1)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    bf16_a, q8_a = f32(8, 32), f32(4, 64)   # quantized by the writer
    tensors = [
        ("blk.0.attn_q.weight.lora_a", f32(4, 16), None),          # ne [16, 4]
        ("blk.0.attn_q.weight.lora_b", f32(24, 4), None),          # ne [4, 24]
        ("blk.0.attn_k.weight.lora_a", f32(4, 16).astype(np.float16), None),
        ("blk.0.attn_k.weight.lora_b", f32(8, 4).astype(np.float16), None),
        ("blk.0.ffn_up.weight.lora_a", q8_a, T.Q8_0),              # ne [64, 4]
        ("blk.0.ffn_up.weight.lora_b", f32(40, 4), None),
        ("blk.0.ffn_down.weight.lora_a", bf16_a, T.BF16),          # ne [32, 8]
        ("blk.0.ffn_down.weight.lora_b", f32(16, 8), T.BF16),
        ("token_embd.weight.lora_a", f32(32, 4), None),            # ne [4, 32]: per token
        ("token_embd.weight.lora_b", f32(16, 4), None),            # ne [4, 16]
        ("blk.0.attn_norm.weight", f32(16), None),                 # skipped with a warning
    ]
    path = Path(tmp) / "seed-small.gguf"
    write_gguf(path, tensors, name=SEED_NAME, extra_kv={"general.tags": ["a", "bb"]})
    f64 = Path(tmp) / "seed-f64.gguf"
    write_gguf(f64, [("output.weight.lora_a", rng.standard_normal((2, 8)), None),
                     ("output.weight.lora_b", rng.standard_normal((6, 2)), None)], alpha=None,
               name=SEED_NAME)
    return [
        _gguf_seed("gguf-small-mixed-types", path.read_bytes()),
        _gguf_seed("gguf-f64-no-alpha", f64.read_bytes()),
        _gguf_seed("gguf-fixture", (FIXTURES / "gguf" / "lora_r8_alpha16_f32.gguf").read_bytes()),
    ]


# ---------------------------------------------------------------------------- the mutations


def _put_int(buf, off, width, value):
    if off + width <= len(buf):
        buf[off:off + width] = (value % (1 << (8 * width))).to_bytes(width, "little")


def _int_value(draw, old=None):
    choices = [st.sampled_from(INTERESTING), st.integers(-(2**63), 2**64 - 1),
               st.integers(0, 40)]
    if old is not None:
        choices.append(st.sampled_from([old + 1, old - 1, old * 2, old * 4096, -old]))
    return draw(st.one_of(*choices))


def byte_mutations(draw, seed, buf, log):
    """Bit flips, byte splices and integers over header fields; in place on `buf`."""
    for _ in range(draw(st.integers(0, 4))):
        if not buf:
            return
        op = draw(st.sampled_from(["flip", "flip_header", "field", "field", "splice"]))
        if op == "flip" or (op == "flip_header" and seed.header_end):
            hi = len(buf) if op == "flip" else min(seed.header_end, len(buf))
            pos = draw(st.integers(0, max(hi - 1, 0)))
            bit = draw(st.integers(0, 7))
            buf[pos] ^= 1 << bit
            log.append(f"flip byte {pos} bit {bit}")
        elif op == "field" and seed.fields:
            off, width, label = draw(st.sampled_from(seed.fields))
            old = int.from_bytes(buf[off:off + width], "little") if off + width <= len(buf) else 0
            value = _int_value(draw, old)
            _put_int(buf, off, width, value)
            log.append(f"{label}@{off}: {old} -> {value}")
        elif op == "splice":
            pos = draw(st.integers(0, len(buf) - 1))
            new = draw(st.binary(min_size=1, max_size=8))
            buf[pos:pos + 8] = new
            log.append(f"splice {new!r} over bytes {pos}..{pos + 8}")


def truncate(draw, buf, log):
    if draw(st.integers(0, 4)) == 0 and buf:
        at = draw(st.integers(0, len(buf) - 1))
        del buf[at:]
        log.append(f"truncate to {at} bytes")


def safetensors_header_edit(draw, data, log):
    """Edit the JSON header: dtype, shape, offsets, names; re-serialise (length usually right)."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    keys = [k for k in header if k != "__metadata__"]
    key = draw(st.sampled_from(keys))
    op = draw(st.sampled_from(["dtype", "shape", "offsets", "delete", "rename", "duplicate",
                               "metadata", "entry"]))
    dup = None
    if op == "dtype":
        header[key]["dtype"] = draw(st.one_of(st.sampled_from(ST_DTYPES), st.integers(), st.none()))
    elif op == "shape":
        dims = st.one_of(st.integers(-3, 80), st.sampled_from(HUGE), st.just(-(2**63)))
        header[key]["shape"] = draw(st.one_of(st.lists(dims, max_size=4), st.just("4"),
                                              st.just([[2, 2]])))
    elif op == "offsets":
        a, b = header[key]["data_offsets"]
        v = st.one_of(st.sampled_from([0, a, b, len(body), len(body) + 1] + HUGE),
                      st.integers(-(2**63), 2**64))
        header[key]["data_offsets"] = draw(st.one_of(st.tuples(v, v).map(list),
                                                     st.just([b, a]), st.just([a])))
    elif op == "delete":
        del header[key]
    elif op == "rename":
        mod = key.rsplit(".lora_", 1)[0]
        new = draw(st.sampled_from([
            key.replace("base_model.model.", "", 1), "base_model.model." + key,
            key.replace(".weight", ".default.weight"), key.replace(".weight", ".other.weight"),
            key.replace("lora_A", "lora_B"), key.replace("lora_B", "lora_A"),
            key.replace("lora_embedding_A", "lora_A.weight"),
            mod + ".lora_magnitude_vector", mod + ".something_else", "", "x" * 300]))
        header[new] = header.pop(key)
    elif op == "duplicate":
        dup = key
    elif op == "metadata":
        header["__metadata__"] = draw(st.sampled_from([{"format": "pt"}, {"a": 1}, [], "x", None]))
    else:
        header[key] = draw(st.sampled_from([{}, [], 7, None, {"dtype": "F32"}]))
    text = json.dumps(header)
    if dup is not None:  # the same name twice in one JSON object
        entry = json.dumps({dup: header[dup]})[1:-1]
        text = text[:-1] + ", " + entry + "}"
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    length = len(raw)
    if draw(st.integers(0, 5)) == 0:
        length = _int_value(draw, length)
    log.append(f"header {op} {key!r}: header_len {length}, {text[:600]!r}")
    return bytearray(struct.pack("<Q", length % (1 << 64)) + raw + body)


def config_edit(draw, config, log):
    cfg = json.loads(config)
    keys = ["r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
            "peft_type", "use_dora", "fan_in_fan_out", "bias", "lora_bias", "modules_to_save"]
    values = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**70), st.sampled_from(
        [0, 0.5, 1e308, "8", "LORA", "ADALORA", [], ["q_proj"], {}, {"q_proj": 0},
         {"(": 4}, {".*": 2.0}, {"v_proj": "x"}, ".*", "[", "all-linear"]))
    op = draw(st.sampled_from(["set", "set", "delete", "junk", "nan"]))
    if op == "junk":
        junk = draw(st.sampled_from([b"", b"{", b"[]", b"\xff\xfe", b"null", config[:40]]))
        log.append(f"config replaced by {junk!r}")
        return junk
    key = draw(st.sampled_from(keys))
    if op == "delete":
        cfg.pop(key, None)
        log.append(f"config: delete {key}")
    elif op == "nan":
        log.append(f"config: {key} = NaN")
        return json.dumps(dict(cfg, **{key: float("nan")})).encode()
    else:
        cfg[key] = draw(values)
        log.append(f"config: {key} = {cfg[key]!r}")
    return json.dumps(cfg).encode()


def gguf_name_edit(draw, seed, buf, log):
    """Two strings of one length made equal: duplicate tensor names or duplicate keys."""
    by_len = {}
    for off, n in seed.names:
        by_len.setdefault(n, []).append(off)
    pairs = [offs for offs in by_len.values() if len(offs) > 1]
    if not pairs:
        return
    offs = draw(st.sampled_from(pairs))
    src, dst = draw(st.sampled_from(offs)), draw(st.sampled_from(offs))
    n = next(n for o, n in seed.names if o == src)
    if src + n <= len(buf) and dst + n <= len(buf):
        buf[dst:dst + n] = bytes(buf[src:src + n])
        log.append(f"string@{dst} := string@{src} {bytes(buf[src:src + n])!r}")


@st.composite
def mutated_peft(draw, seeds):
    seed = draw(st.sampled_from(seeds))
    data, config, log = bytearray(seed.data), seed.config, []
    if draw(st.integers(0, 2)) == 0:
        data = safetensors_header_edit(draw, seed.data, log)
    if draw(st.integers(0, 5)) == 0:
        config = config_edit(draw, seed.config, log)
    byte_mutations(draw, seed, data, log)
    truncate(draw, data, log)
    return Case(seed, bytes(data), config, log)


@st.composite
def mutated_gguf(draw, seeds):
    seed = draw(st.sampled_from(seeds))
    buf, log = bytearray(seed.data), []
    if draw(st.integers(0, 4)) == 0:
        gguf_name_edit(draw, seed, buf, log)
    byte_mutations(draw, seed, buf, log)
    truncate(draw, buf, log)
    return Case(seed, bytes(buf), log=log)


# ------------------------------------------------------------------------- fixtures, tests


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-seeds")


@pytest.fixture(scope="module")
def peft_seeds():
    return build_peft_seeds()


@pytest.fixture(scope="module")
def gguf_seeds(seed_dir):
    return build_gguf_seeds(seed_dir)


@pytest.fixture(scope="module")
def worker(seed_dir, peft_seeds, gguf_seeds):
    # warm-up inputs: one valid file of each kind
    d = seed_dir / "warm-peft"
    d.mkdir(exist_ok=True)
    (d / "adapter_model.safetensors").write_bytes(peft_seeds[0].data)
    (d / "adapter_config.json").write_bytes(peft_seeds[0].config)
    g = seed_dir / "warm.gguf"
    g.write_bytes(gguf_seeds[0].data)
    w = Worker([["peft", str(d)], ["gguf", str(g)]])
    yield w
    w.close()


def write_peft_bytes(dirpath, data, config):
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "adapter_model.safetensors").write_bytes(data)
    (dirpath / "adapter_config.json").write_bytes(config)
    return dirpath


FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                HealthCheck.function_scoped_fixture])


def test_seeds_load(worker, peft_seeds, gguf_seeds, seed_dir):
    """Every unmutated seed loads: the mutations start from valid files."""
    for s in peft_seeds:
        res = worker.load("peft", write_peft_bytes(seed_dir / ("ok-" + s.name), s.data, s.config))
        assert res["outcome"] == "ok", (s.name, res)
    for s in gguf_seeds:
        p = seed_dir / ("ok-" + s.name + ".gguf")
        p.write_bytes(s.data)
        res = worker.load("gguf", p)
        assert res["outcome"] == "ok", (s.name, res)


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_peft(data, worker, peft_seeds, seed_dir):
    case = data.draw(mutated_peft(peft_seeds))
    path = write_peft_bytes(seed_dir / "peft-case", case.data, case.config)
    check_outcome(worker.load("peft", path), "peft", path)


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzz_gguf(data, worker, gguf_seeds, seed_dir):
    case = data.draw(mutated_gguf(gguf_seeds))
    path = seed_dir / "case.gguf"
    path.write_bytes(case.data)
    check_outcome(worker.load("gguf", path), "gguf", path)


# ------------------------------------------------------ a fixed corpus: LoraFormatError each


def _st_with_header(seed, edit, length=None):
    (n,) = struct.unpack_from("<Q", seed.data, 0)
    header = json.loads(seed.data[8:8 + n])
    body = seed.data[8 + n:]
    text = edit(header)
    if not isinstance(text, str):
        text = json.dumps(text)
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + body


def _first_key(h, part="lora_A"):
    return next(k for k in h if part in k)


def _set(h, key, field_, value):
    h = copy.deepcopy(h)
    h[key][field_] = value
    return h


def _peft_cases(seed):
    """name -> (weights bytes, config bytes)"""
    d, c = seed.data, seed.config
    A = lambda h: _first_key(h)  # noqa: E731

    def dup(h):  # lora_A's name a second time, for lora_B's bytes (an identical repeat of an
        k = A(h)  # entry is unambiguous, and safetensors accepts it: the fuzz loop covers that)
        return json.dumps(h)[:-1] + ", " + json.dumps({k: h[_first_key(h, "lora_B")]})[1:-1] + "}"

    nan_body = bytearray(d)
    (n,) = struct.unpack_from("<Q", d, 0)
    hdr = json.loads(d[8:8 + n])
    k = A(hdr)
    off = 8 + n + hdr[k]["data_offsets"][0]
    nan_body[off:off + 4] = struct.pack("<f", float("nan"))
    return {
        "empty": (b"", c),
        "truncated-half": (d[: len(d) // 2], c),
        "truncated-in-header": (d[:20], c),
        "header-len-huge": (struct.pack("<Q", 2**63) + d[8:], c),
        "header-len-past-end": (struct.pack("<Q", len(d)) + d[8:], c),
        "dtype-I32": (_st_with_header(seed, lambda h: _set(h, A(h), "dtype", "I32")), c),
        "dtype-unknown": (_st_with_header(seed, lambda h: _set(h, A(h), "dtype", "XX")), c),
        "shape-negative": (_st_with_header(seed, lambda h: _set(h, A(h), "shape", [-4, 16])), c),
        "shape-terabyte": (_st_with_header(seed, lambda h: _set(h, A(h), "shape",
                                                                [2**20, 2**20])), c),
        "shape-3d": (_st_with_header(seed, lambda h: _set(h, A(h), "shape", [4, 4, 1])), c),
        "offsets-past-end": (_st_with_header(seed, lambda h: _set(
            h, A(h), "data_offsets", [0, 2**40])), c),
        "duplicate-name": (_st_with_header(seed, dup), c),
        "missing-half": (_st_with_header(seed, lambda h: {
            k: v for k, v in h.items() if k != A(h)}), c),
        "unknown-key": (_st_with_header(seed, lambda h: dict(h, **{"model.foo.bias": h[A(h)]})),
                        c),
        "nan-value": (bytes(nan_body), c),
        "config-r-mismatch": (d, json.dumps(dict(json.loads(c), r=3)).encode()),
        "config-junk": (d, b"{not json"),
        "config-use-dora": (d, json.dumps(dict(json.loads(c), use_dora=True)).encode()),
        "config-r-zero": (d, json.dumps(dict(json.loads(c), r=0)).encode()),
        "config-not-lora": (d, json.dumps(dict(json.loads(c), peft_type="IA3")).encode()),
        "not-safetensors": (b"GGUF" + bytes(100), c),
    }


def _gguf_cases(seed):
    d = bytearray(seed.data)
    by_label = {}
    for off, width, label in seed.fields:
        by_label.setdefault(label, []).append((off, width))

    def patched(label, value, index=0):
        b = bytearray(d)
        off, width = by_label[label][index]
        _put_int(b, off, width, value)
        return bytes(b)

    dup = bytearray(d)
    names = [(o, n) for o, n in seed.names if bytes(d[o:o + n]).endswith(b".lora_a")]
    same = [(o1, o2, n1) for (o1, n1) in names for (o2, n2) in names if o1 < o2 and n1 == n2]
    o1, o2, n = same[0]
    dup[o2:o2 + n] = d[o1:o1 + n]
    return {
        "empty": b"",
        "magic-only": b"GGUF",
        "truncated-header": bytes(d[:30]),
        "truncated-infos": bytes(d[: seed.header_end - 5]),
        "truncated-data": bytes(d[: (seed.header_end + len(d)) // 2]),
        "n_tensors-huge": patched("n_tensors", 2**63 - 1),
        "n_kv-huge": patched("n_kv", 2**62),
        "key-len-huge": patched("kv.key.len", 2**64 - 1),
        "array-count-huge": patched("kv.value.array_count", 2**60),
        "tensor-name-len-huge": patched("tensor.name.len", 2**40),
        "n_dims-huge": patched("tensor.n_dims", 2**31),
        "ne-terabyte": patched("tensor.ne[0]", 2**40),
        "ne-wraps-to-zero": patched("tensor.ne[0]", 2**63),
        "tensor-type-unknown": patched("tensor.type", 99),
        "tensor-type-I32": patched("tensor.type", 26),
        "tensor-offset-past-end": patched("tensor.offset", 2**50),
        "duplicate-tensor-name": bytes(dup),
        "version-99": patched("version", 99),
        "not-gguf": b"PK\x03\x04" + bytes(d[4:]),
    }


@pytest.fixture(scope="module")
def corpus(seed_dir, peft_seeds, gguf_seeds):
    cases = []
    for name, (weights, config) in _peft_cases(peft_seeds[0]).items():
        cases.append(("peft", name, write_peft_bytes(seed_dir / f"corpus-peft-{name}", weights, config)))
    for name, blob in _gguf_cases(gguf_seeds[0]).items():
        p = seed_dir / f"corpus-{name}.gguf"
        p.write_bytes(blob)
        cases.append(("gguf", name, p))
    # semantic GGUF cases, written by the real writer
    rng = np.random.default_rng(3)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ok_pair = [("blk.0.attn_q.weight.lora_a", f32(4, 16), None),
               ("blk.0.attn_q.weight.lora_b", f32(24, 4), None)]
    bad_nan = f32(24, 4)
    bad_nan[3, 1] = np.inf
    semantic = {
        "writer-wrong-general-type": dict(tensors=ok_pair, general_type="model"),
        "writer-no-adapter-type": dict(tensors=ok_pair, adapter_type=None),
        "writer-missing-half": dict(tensors=ok_pair[:1]),
        "writer-rank-mismatch": dict(tensors=[ok_pair[0],
                                              ("blk.0.attn_q.weight.lora_b", f32(24, 3), None)]),
        "writer-int-tensor": dict(tensors=[ok_pair[0], ("blk.0.attn_q.weight.lora_b",
                                                        np.ones((24, 4), np.int32), None)]),
        "writer-inf-value": dict(tensors=[ok_pair[0],
                                          ("blk.0.attn_q.weight.lora_b", bad_nan, None)]),
        "writer-unknown-tensor": dict(tensors=ok_pair + [("blk.0.attn_q.bias", f32(24), None)]),
        "writer-3d-tensor": dict(tensors=[("blk.0.attn_q.weight.lora_a", f32(2, 4, 16), None),
                                          ok_pair[1]]),
        "writer-alpha-string": dict(tensors=ok_pair, alpha=None,
                                    extra_kv={"adapter.lora.alpha": "16"}),
        "writer-no-tensors": dict(tensors=[]),
    }
    for name, kw in semantic.items():
        p = seed_dir / f"corpus-{name}.gguf"
        write_gguf(p, name=SEED_NAME, **kw)
        cases.append(("gguf", name, p))
    return cases


def test_corpus_every_bad_file_is_a_lora_format_error(worker, corpus):
    """Each hand-made bad file: LoraFormatError naming the file, bounded allocation."""
    failures = []
    for kind, name, path in corpus:
        res = worker.load(kind, path)
        try:
            check_refused(res, kind, path)
        except AssertionError as exc:
            failures.append(f"{kind}/{name}: {exc}")
    assert not failures, f"{len(failures)} of {len(corpus)} bad files:\n" + "\n".join(failures)


@pytest.mark.parametrize("ne", [[2**20, 2**20], [2**40, 4], [2**32, 2**32], [2**31, 2**33 + 1]],
                         ids=["4TiB", "16TiB-rank4", "2^64-wraps", "odd-overflow"])
def test_gguf_terabyte_tensor_refused_before_allocating(ne, worker, seed_dir):
    """A GGUF whose tensor info declares a terabyte-sized lora_a (the data is 256 bytes): refused
    with LoraFormatError, with a small traced peak and, outside ASan, under an address-space
    limit of the worker's size + 2 GiB."""
    rng = np.random.default_rng(4)
    p = seed_dir / "terabyte.gguf"
    write_gguf(p, [("blk.0.attn_q.weight.lora_a", rng.standard_normal((4, 16)).astype(np.float32),
                    None),
                   ("blk.0.attn_q.weight.lora_b", rng.standard_normal((24, 4)).astype(np.float32),
                    None)], name=SEED_NAME)
    buf = bytearray(p.read_bytes())
    fields, _, _ = gguf_layout(buf)
    dims = [off for off, width, label in fields if label.startswith("tensor.ne[")][:2]
    for off, value in zip(dims, ne):
        _put_int(buf, off, 8, value)
    p.write_bytes(bytes(buf))
    res = worker.load("gguf", p)
    check_refused(res, "gguf", p)
    assert res["peak"] < ALLOC_SLACK, res


# ------------------------------------- loader findings of the fuzzer, fixed and kept as tests


def _small_pair(seed=5):
    rng = np.random.default_rng(seed)
    return [("blk.0.attn_q.weight.lora_a", rng.standard_normal((4, 16)).astype(np.float32), None),
            ("blk.0.attn_q.weight.lora_b", rng.standard_normal((24, 4)).astype(np.float32), None)]


@pytest.mark.parametrize("case", ["valid-150k-array", "one-byte-string-to-array"])
def test_gguf_metadata_array_allocation_is_bounded(case, worker, seed_dir):
    """valid-150k-array: a valid adapter plus one 150 000-element int32 metadata array (a 600 KB
    file).  one-byte-string-to-array: the upstream fixture with general.type's value type changed
    from STRING (8) to ARRAY (9), found by the fuzzer: the string's bytes become a bool array that
    runs to the end of the file, 84 KB of elements, before the load is refused.  Either way the
    load must stay within the allocation bound every other file meets."""
    if case == "valid-150k-array":
        p = seed_dir / "big-array.gguf"
        write_gguf(p, _small_pair(), name=SEED_NAME, extra_kv={"general.junk": [1] * 150_000})
    else:
        buf = bytearray((FIXTURES / "gguf" / "lora_r8_alpha16_f32.gguf").read_bytes())
        fields, names, _ = gguf_layout(buf)
        key_off = next(o for o, n in names if bytes(buf[o:o + n]) == b"general.type")
        type_off = next(o for o, w, label in fields if label == "kv.type" and o > key_off)
        _put_int(buf, type_off, 4, 9)
        p = seed_dir / "string-to-array.gguf"
        p.write_bytes(bytes(buf))
    check_outcome(worker.load("gguf", p), "gguf", p)


@pytest.mark.parametrize("key", ["general.name", "general.type", "adapter.type"])
def test_gguf_non_utf8_string_value_is_a_format_error(key, worker, seed_dir):
    p = seed_dir / "utf8.gguf"
    write_gguf(p, _small_pair(), name=SEED_NAME)
    buf = bytearray(p.read_bytes())
    fields, names, _ = gguf_layout(buf)
    # the value string right after the key string `key`
    for (off, n), (voff, vn) in zip(names, names[1:]):
        if bytes(buf[off:off + n]) == key.encode():
            buf[voff] = 0xFF
            break
    else:
        pytest.fail(f"{key} not in the seed")
    p.write_bytes(bytes(buf))
    check_refused(worker.load("gguf", p), "gguf", p)
