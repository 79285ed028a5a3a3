"""The script ``hasten launch`` tests start: it prints how many accelerators this process sees, the
way hasten picks them (``Successfully ran on N GPUs``; XPUs likewise)."""

from __future__ import annotations

from hasten.test_utils.backend import device_count, torch_device


def main() -> None:
    kind = "XPU" if torch_device == "xpu" else "GPU"
    count = device_count if torch_device in ("cuda", "xpu") else 0
    print(f"Successfully ran on {count} {kind}s")


if __name__ == "__main__":
    main()
