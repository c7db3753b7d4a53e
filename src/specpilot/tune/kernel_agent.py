"""The kernel sub-agent: an LLM writes a Triton kernel for a slot; the sandbox judges it.

:meth:`KernelAgent.propose` briefs the agent on one kernel slot (``kernels/slots.py``: what it
computes and promises, the entry's signature, the shapes the engine runs it at, the current
kernel, the reasons earlier sources for this slot were rejected on this device), reads its JSON
answer (``{"entry", "source", "shapes", "hypothesis"}``), and hands the source to the sandbox
(``tune/kernel_sandbox.py``: a separate process, a time limit, the outputs checked bit for bit
against the reference in this process, then timed against the current kernel). Every judged
source goes into the memory with its verdict and checks; :func:`offers` lists the accepted ones
that beat the current kernel somewhere: the candidates a kernel search may take, and
:func:`load_offer` imports one, only ever a source the memory holds as accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specpilot.kernels.offers import OfferRef, load_offer, source_hash
from specpilot.kernels.slots import KernelSlot, Shape, resolve_slot
from specpilot.memory.store import MemoryStore
from specpilot.tune.agent_client import AgentClient, AgentFailure
from specpilot.tune.agent_parse import extract_json
from specpilot.tune.agent_price import AgentPrice
from specpilot.tune.kernel_sandbox import SandboxVerdict, precheck, run_sandbox

FEEDBACK_KEPT = 5
"""Earlier rejections of this slot (the latest) the brief repeats."""

KERNEL_SCHEMA = {
    "entry": "the kernel's Python function name",
    "source": "the whole Python module: imports, @triton.jit kernels, and the entry function",
    "shapes": "the shapes (from the list) it is meant for, as objects",
    "hypothesis": "one line: why it beats the current kernel there",
}


@dataclass(slots=True)
class KernelOutcome:
    slot: str
    verdict: SandboxVerdict
    stored: int | None
    """The memory's row id (None: nothing got as far as the sandbox)."""
    hypothesis: str = ""


@dataclass(frozen=True, slots=True)
class KernelOffer(OfferRef):
    """An accepted kernel that beat the current one at some shapes on this device."""

    faster_at: list[dict[str, int]]
    timings: list[dict[str, Any]]

    def ref(self) -> OfferRef:
        return OfferRef(self.slot, self.device, self.source_hash, self.entry, self.row)


def kernel_brief(
    slot: KernelSlot, shapes: Sequence[Shape], feedback: Sequence[str]
) -> list[dict[str, str]]:
    parts = [
        f"Write a Triton kernel for the slot {slot.name}: {slot.summary}",
        f"Signature: {slot.signature}.",
        "Shapes the engine runs it at here: " + json.dumps([dict(s) for s in shapes]),
        f"The current kernel (your baseline, same signature): {slot.current}.",
        "Your source runs in a separate process with a time limit; its outputs are checked "
        "against the reference at every shape you claim (a failed check rejects it), then it "
        "is timed against the current kernel. It may import torch, triton and specpilot.",
    ]
    if feedback:
        parts += ["Earlier sources for this slot were rejected:", *[f"- {f}" for f in feedback]]
    parts.append("Answer with one JSON object only, fields: " + json.dumps(KERNEL_SCHEMA))
    return [
        {"role": "system", "content": "You write fast, exact GPU kernels. Answer in JSON only."},
        {"role": "user", "content": "\n".join(parts)},
    ]


class KernelAgent:
    """One endpoint's kernel proposals for one device, judged and remembered."""

    def __init__(
        self,
        client: AgentClient,
        store: MemoryStore,
        device: str,
        device_key: str,
        price: AgentPrice,
        time_limit_s: float = 300.0,
        interpret: bool = False,
        real: tuple[str, str] | None = None,
        log: Callable[[str], None] = print,
        **sandbox: Any,
    ) -> None:
        self.client, self.store, self.price, self.log = client, store, price, log
        self.device, self.device_key = device, device_key
        """Where it runs (``cuda``, ``cpu``), and the key its results are kept under (the GPU)."""
        self.time_limit_s, self.interpret, self.real, self.sandbox = (
            time_limit_s,
            interpret,
            real,
            sandbox,
        )

    def feedback(self, slot: str) -> list[str]:
        rows = self.store.kernels(slot=slot, device=self.device_key, accepted=False)
        return [f"{r.verdict.get('stage')}: {r.verdict.get('reason')}" for r in rows][
            -FEEDBACK_KEPT:
        ]

    def propose(self, slot_name: str, shapes: Sequence[Shape] | None = None) -> KernelOutcome:
        slot = resolve_slot(slot_name)
        shapes = list(shapes or slot.shapes)
        reply = self.client.chat(kernel_brief(slot, shapes, self.feedback(slot.name)))
        self.price.record(reply)
        if isinstance(reply, AgentFailure):
            return self._refused(slot, f"the agent's call failed: {reply.reason}")
        try:
            answer = extract_json(reply.text)
        except ValueError as e:
            return self._refused(slot, str(e))
        if not isinstance(answer, dict):
            return self._refused(slot, "the answer is JSON but not an object")
        source, entry = answer.get("source"), answer.get("entry")
        claimed: list[dict[str, int]] = answer.get("shapes") or [dict(s) for s in shapes]
        hypothesis = " ".join(str(answer.get("hypothesis", "")).split())[:160]
        why = precheck(source, entry, slot, claimed, shapes)
        if why is not None:
            return self._refused(slot, why)
        assert isinstance(source, str) and isinstance(entry, str)
        self.price.kernels += 1
        verdict = run_sandbox(
            source, entry, slot_name, claimed, self.device, self.time_limit_s,
            real=self.real, interpret=self.interpret, **self.sandbox,
        )  # fmt: skip
        row = self.store.add_kernel(
            slot.name, self.device_key, source_hash(source), entry, source, claimed,
            verdict.to_dict(), hypothesis,
        )  # fmt: skip
        self.log(f"  [kernel-agent:{slot.name}] {verdict.summary()} ({verdict.wall_s:.1f} s)")
        return KernelOutcome(slot.name, verdict, row, hypothesis)

    def _refused(self, slot: KernelSlot, why: str) -> KernelOutcome:
        self.log(f"  [kernel-agent:{slot.name}] rejected: {why}")
        return KernelOutcome(slot.name, SandboxVerdict(False, "refused", why), None)


def offers(store: MemoryStore, slot: str, device_key: str) -> list[KernelOffer]:
    """Accepted kernels of ``slot`` on this device that beat its current kernel somewhere."""
    out = []
    for r in store.kernels(slot=slot, device=device_key, accepted=True):
        if r.verdict.get("faster_at"):
            out.append(KernelOffer(
                r.slot, r.device, r.source_hash, r.entry, r.id, r.verdict["faster_at"],
                r.verdict.get("timings", []),
            ))  # fmt: skip
    return out


def ask_for_kernels(
    client: AgentClient,
    store: MemoryStore,
    price: AgentPrice,
    device: Any,  # torch.device
    matrices: Mapping[tuple[int, int], Sequence[Any]],  # [N, K] -> the target's bf16 weights
    widths: Sequence[int],
    count: int,
    time_limit_s: float,
    log: Callable[[str], None] = print,
) -> list[KernelOutcome]:
    """``tune --kernel-agent N``: ``count`` proposals for the ``w12-gemm`` slot at the target's
    weight shapes and widths, each judged in the sandbox (the first matrix as the real weight,
    tiled or cropped to every shape) and stored under this GPU's fingerprint key, where the
    kernel search finds the accepted ones."""
    import os
    import tempfile

    from safetensors.torch import save_file

    from specpilot.memory.fingerprint import gpu_fingerprint

    shapes = [{"m": int(m), "n": n, "k": k} for n, k in matrices for m in sorted(set(widths))]
    first = next(iter(matrices.values()))[0]
    with tempfile.TemporaryDirectory(prefix="specpilot-kernel-agent-") as tmp:
        real = str(Path(tmp) / "weight.safetensors")
        save_file({"w": first.detach().to("cpu").contiguous()}, real)
        agent = KernelAgent(
            client, store, str(device), gpu_fingerprint(device)["key"], price, time_limit_s,
            interpret=os.environ.get("TRITON_INTERPRET") == "1", real=(real, "w"), log=log,
        )  # fmt: skip
        out = []
        for _ in range(count):  # the search waits for each: all of the wait stands it still
            waited = price.wait_seconds
            out.append(agent.propose("w12-gemm", shapes))
            price.blocked_seconds += price.wait_seconds - waited
        return out


__all__ = [
    "KernelAgent",
    "KernelOffer",
    "KernelOutcome",
    "ask_for_kernels",
    "kernel_brief",
    "load_offer",
    "offers",
    "source_hash",
]
