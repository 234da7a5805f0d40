"""Device profiles: the rates the cost model runs on, one file per (GPU, software stack).

    chunkflow simulate --gpu-profile h200-torch2.11-local     # a built-in profile
    chunkflow simulate --gpu-profile my_h100.json             # one `chunkflow calibrate` wrote

A profile is a JSON object:

    {"name": "...", "gpu": "h200", "stack": "torch 2.11 + CUDA 13, ...", "calibrated": true,
     "rates": {"gemm_max_eff": {"value": 0.697, "label": "measured", "source": "..."}, ...}}

`gpu` names the datasheet device (perfmodel/hardware.py GPUS: peak, memory bandwidth, links) and
`rates` set Hardware fields on it: each a physical rate or a property of the build, never a
correction of one configuration's time, labelled measured, datasheet, published, fitted or build,
with where it comes from. `calibrated` says whether the rates were set against measured steps or
microbenchmarks on that device (a bare datasheet device, `--gpu h100`, is not: its efficiencies
are perfmodel/hardware.py's stated assumptions). Built-in profiles live beside this module
(gpu_profiles/*.json); the datasheet devices are profiles too, by their names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megatron_chunkflow.perfmodel.hardware import GPUS, IDENTITY, Hardware, with_overrides

PROFILE_DIR = Path(__file__).with_name("gpu_profiles")
# Step seconds measured on one H200 (torch 2.11 + CUDA 13, bf16, the local spec with every fusion
# off, attention varlen), Qwen2.5-1.5B at 32K, one global batch of 128 profile-B sequences (seed
# 0, clipped to 32K, one above 16K: 159,485 tokens, longest 28,112), the mean after the first
# step: (system, chunk size, K, recompute) -> seconds. What h200-torch2.11-local was set against.
REFERENCE_STEPS = {("chunkflow", 16384, 1, "none"): 5.19, ("chunkflow", 8192, 2, "none"): 5.70,
                   ("chunkflow", 8192, 1, "none"): 6.11,
                   ("megatron-packed", None, None, "full"): 6.09}
REFERENCE_MODEL, REFERENCE_SEQ = "qwen2.5-1.5b", 32768
LABELS = ("measured", "datasheet", "published", "fitted", "build", "assumed")


def reference_batch() -> list[int]:
    """The lengths of REFERENCE_STEPS' global batch."""
    from megatron_chunkflow.core.profiles import ensure_long, sample_lengths

    lengths = [min(n, REFERENCE_SEQ) for n in sample_lengths("B", 128, seed=0)]
    lengths = ensure_long(lengths, "B", REFERENCE_SEQ // 2, 1, 0)
    return [max(2, min(n, REFERENCE_SEQ)) for n in lengths]


def reference_predictions(hw: Hardware) -> dict:
    """REFERENCE_STEPS' rows predicted on `hw`: row -> seconds."""
    from megatron_chunkflow.config import ParallelConfig, Recompute
    from megatron_chunkflow.core.models import get_model_shape
    from megatron_chunkflow.perfmodel.predict import predict_chunkflow, predict_megatron

    lengths, shape = reference_batch(), get_model_shape(REFERENCE_MODEL)
    out = {}
    for row in REFERENCE_STEPS:
        system, c, k, recompute = row
        layout = ParallelConfig(dp=1, recompute=Recompute.parse(recompute))
        out[row] = (predict_chunkflow(lengths, shape, hw, layout, c, k) if system == "chunkflow"
                    else predict_megatron(lengths, shape, hw, layout, REFERENCE_SEQ,
                                          baseline=system)).step_s
    return out


def builtin_profiles() -> list[str]:
    """Names of the built-in profiles (gpu_profiles/*.json)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def profile_names() -> list[str]:
    """Everything --gpu-profile takes by name: the datasheet devices and the built-in files."""
    return sorted(GPUS) + builtin_profiles()


def describe(hw: Hardware) -> str:
    """One line naming where a device's rates come from, for every printed figure."""
    if hw.calibrated:
        return f"device profile {hw.profile} (calibrated)"
    if hw.profile and hw.profile not in GPUS:
        return f"device profile {hw.profile} (not calibrated)"
    return (f"device profile {hw.name} (datasheet; efficiencies assumed, not calibrated: "
            "perfmodel/hardware.py)")


def load_profile(spec: str, flag: str = "--gpu-profile") -> Hardware:
    """The Hardware of a profile named `spec` (a datasheet device or a built-in file) or of the
    JSON file at path `spec`; ValueError naming the flag, file and key on anything wrong."""
    if spec in GPUS:
        return dataclasses.replace(GPUS[spec], profile=spec)
    path = PROFILE_DIR / f"{spec}.json"
    if not path.is_file():
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"{flag} {spec!r}: neither a profile ({', '.join(profile_names())}) "
                             "nor a file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not JSON (line {e.lineno}: {e.msg})") from None
    return profile_hardware(data, f"{flag} {path}")


def profile_hardware(data, where: str) -> Hardware:
    """A profile object (module docstring) made Hardware; `where` prefixes every error."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for key in ("name", "gpu", "rates"):
        if key not in data:
            raise ValueError(f"{where}: no {key!r}")
    if data["gpu"] not in GPUS:
        raise ValueError(f"{where}: gpu {data['gpu']!r} is not a datasheet device "
                         f"({', '.join(GPUS)})")
    if not isinstance(data["rates"], dict):
        raise ValueError(f"{where}: 'rates' must be an object")
    fields = {f.name: f for f in dataclasses.fields(Hardware) if f.name not in IDENTITY}
    values = {}
    for key, entry in data["rates"].items():
        if key not in fields:
            raise ValueError(f"{where}: rate {key!r} is not a Hardware field "
                             f"({', '.join(fields)})")
        if not isinstance(entry, dict) or "value" not in entry:
            raise ValueError(f"{where}: rate {key!r} must be an object with a 'value'")
        if entry.get("label") not in LABELS:
            raise ValueError(f"{where}: rate {key!r} has label {entry.get('label')!r}; each "
                             f"number says where it comes from: one of {', '.join(LABELS)}")
        values[key] = _typed(fields[key], entry["value"], f"{where}: rate {key!r}")
    try:
        return dataclasses.replace(GPUS[data["gpu"]], profile=str(data["name"]),
                                   calibrated=data.get("calibrated") is True, **values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _typed(field, value, where: str):
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    return int(value) if kind == "int" else float(value)


def profile_json(hw: Hardware, rates: dict, stack: str, calibrated: bool = True,
                 **extra) -> dict:
    """A profile object for `hw` with `rates` {field: (label, source)}: what calibrate writes."""
    out = {"name": hw.profile or hw.name, "gpu": hw.name, "stack": stack,
           "calibrated": calibrated, "rates": {}}
    for key, (label, source) in rates.items():
        if label not in LABELS:
            raise ValueError(f"rate {key}: label {label!r} is not one of {', '.join(LABELS)}")
        out["rates"][key] = {"value": getattr(hw, key), "label": label, "source": source}
    out.update(extra)
    return out


def add_device_arguments(g, default: str) -> None:
    """--gpu, --gpu-profile and --gpu-set: the device a prediction is for (device_from_args)."""
    g.add_argument("--gpu", default=None, choices=sorted(GPUS),
                   help=f"GPU type: datasheet numbers and assumed efficiencies, not calibrated "
                        f"(perfmodel/hardware.py; default: {default})")
    g.add_argument("--gpu-profile", default=None, metavar="NAME|FILE",
                   help="the device's rates from a profile, one per GPU and software stack: "
                        f"built in {', '.join(builtin_profiles())}, or a file `chunkflow "
                        "calibrate` wrote (perfmodel/gpu_profiles.py)")
    g.add_argument("--gpu-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one hardware parameter, e.g. nvlink_gb_s=400, cp_overlap=1 or "
                        "kernel_launch_us=10 (repeatable; keys: perfmodel/hardware.py Hardware)")
    g.set_defaults(default_gpu=default)


def device_from_args(args) -> Hardware:
    """The Hardware of --gpu / --gpu-profile with --gpu-set applied; a --gpu naming another
    device than the profile's is refused."""
    if args.gpu_profile:
        hw = load_profile(args.gpu_profile)
        if args.gpu and args.gpu != hw.name:
            raise ValueError(f"--gpu {args.gpu} and --gpu-profile {args.gpu_profile} (a {hw.name} "
                             "profile) name different devices; give one")
    else:
        hw = load_profile(args.gpu or args.default_gpu, "--gpu")
    return with_overrides(hw, args.gpu_set)
