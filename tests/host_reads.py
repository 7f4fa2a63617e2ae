"""What a training step reads back to the host, as the CPU profiler sees it: a GPU's syncs, found
on the CPU (SPEC §5 allows a step one, the trainer's `tolist`, which is no ATen op)."""

from __future__ import annotations

from collections.abc import Iterable

# torch's fused AdamW reads `found_inf` on the host when it runs on the CPU (on a GPU, on the device)
CPU_ONLY_READS = {"aten::item < aten::_fused_adamw_"}


def host_reads(events: Iterable) -> list[str]:
    """The profiled ops that read a tensor's value back to the host (`.item()`, `float(t)`, a Python
    branch on a tensor: each an `aten::_local_scalar_dense`), each named by the ATen ops it was
    called from, innermost first."""
    reads = []
    for event in events:
        if event.name == "aten::_local_scalar_dense":
            chain, parent = [], event.cpu_parent
            while parent is not None and parent.name.startswith("aten::"):
                chain.append(parent.name)
                parent = parent.cpu_parent
            reads.append(" < ".join(chain))
    return reads
