"""Build the fake libnvidia-ml.so.1 (fake_nvml.c) and the static fake nvidia-smi (fake_nvidia_smi.c) with gcc,
and write the fake library's device config."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "fake_nvml.c"
SMI_SOURCE = Path(__file__).resolve().parent / "fake_nvidia_smi.c"
LIBRARY_NAME = "libnvidia-ml.so.1"


def build_fake_nvml(out_dir: Path) -> Path:
    """Compile the fake into out_dir/libnvidia-ml.so.1 and return its path (gcc must be on PATH)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise FileNotFoundError("gcc")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIBRARY_NAME
    subprocess.run(
        [gcc, "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-O1", "-o", str(target), str(SOURCE)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return target


def build_fake_smi(target: Path) -> Path:
    """Compile the fake nvidia-smi, static (it runs chrooted into a bare driver root), to `target`."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise FileNotFoundError("gcc")
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [gcc, "-Wall", "-Wextra", "-Werror", "-static", "-O1", "-o", str(target), str(SMI_SOURCE)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return target


def device_config(*devices: dict[str, object], driver: str = "550.54.15", init_error: int = 0) -> str:
    """Config text for the fake: one dict per GPU; list values repeat the key (processes, errors)."""
    lines = [f"driver {driver}"]
    if init_error:
        lines.append(f"init_error {init_error}")
    for device in devices:
        lines.append("gpu")
        for key, value in device.items():
            for item in value if isinstance(value, list) else [value]:
                lines.append(f"{key} {item}")
    return "\n".join(lines) + "\n"
