"""Per-stage differences between two updates of one batch, against stated tolerances."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_tools.interop.update import UpdateResult


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """What two correct implementations of one update agree to. ``FP32``: about 100x the
    differences measured on the tests' tiny Qwen2/Qwen3/Llama 3 models
    (docs/guide/reproducing.md). ``BF16``: bfloat16 weights on both sides, where the frameworks
    round differently (transformers rounds the logits to bfloat16, we keep them float32).

    Attributes:
      logp: max |Δ| of a response token's log-prob.
      advantages: max |Δ| of an advantage (or return); computed in float32 from the rewards.
      loss: |Δ| / max(|loss|, 1): relative, absolute below 1 (a PPO loss is often near 0).
      grad: max over parameters of ||Δg|| / ||g||.
      weights: max |Δ| of a weight after the optimizer step.
    """

    logp: float = 1e-4
    advantages: float = 1e-5
    loss: float = 1e-5
    grad: float = 1e-4
    weights: float = 1e-6


FP32 = Tolerances()
BF16 = Tolerances(logp=5e-2, advantages=1e-5, loss=1e-2, grad=5e-1, weights=1e-4)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One compared quantity: its difference, the tolerance and whether it passes."""

    name: str
    diff: float
    tolerance: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.diff)) and self.diff <= self.tolerance

    def line(self) -> str:
        flag = "ok  " if self.ok else "FAIL"
        tol = f"(tolerance {self.tolerance:.0e})"
        return f"{flag} {self.name:<34} {self.diff:10.3e}  {tol} {self.detail}".rstrip()


def _max_abs(a, b, mask=None) -> float:
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    if mask is not None:
        d = d * (np.asarray(mask) > 0)
    return float(d.max()) if d.size else 0.0


def grad_differences(ours: dict, ref: dict) -> dict[str, tuple[float, float, float]]:
    """name -> (||g_ours||, ||g_ref||, ||Δ|| / ||g_ref||), every parameter of ``ref``; a name
    missing on our side is a KeyError naming it."""
    out = {}
    for name, g_ref in ref.items():
        if name not in ours:
            raise KeyError(f"parameter {name} has no counterpart here")
        a, b = np.asarray(ours[name], np.float64), np.asarray(g_ref, np.float64)
        norm_ref = float(np.linalg.norm(b))
        rel = float(np.linalg.norm(a - b)) / max(norm_ref, 1e-30)
        out[name] = (float(np.linalg.norm(a)), norm_ref, rel)
    return out


def compare_with_batch(ours: UpdateResult, batch: dict, tol: Tolerances = FP32) -> list[Stage]:
    """Our recomputation against what the batch carries (old_log_probs, advantages, returns):
    did this framework produce the batch's numbers from the same weights?"""
    m = batch["response_mask"]
    stages = []
    if "old_log_probs" in batch:
        d = _max_abs(ours.logp, batch["old_log_probs"], m)
        stages.append(Stage("log-probs vs batch old_log_probs", d, tol.logp))
    for field in ("advantages", "returns"):
        if field in batch:
            d = _max_abs(getattr(ours, field), batch[field], m)
            stages.append(Stage(f"{field} vs batch {field}", d, tol.advantages))
    return stages


def compare_updates(
    ours: UpdateResult, ref: UpdateResult, mask: np.ndarray, tol: Tolerances = FP32
) -> list[Stage]:
    """Stage by stage: log-probs, advantages, returns, loss, gradients, weights after the step."""
    grads = grad_differences(ours.grads, ref.grads)
    worst = max(grads, key=lambda n: grads[n][2])
    weights = {n: _max_abs(ours.params[n], ref.params[n]) for n in ref.params}
    worst_w = max(weights, key=weights.get)
    return [
        Stage("token log-probs (max |Δ|)", _max_abs(ours.logp, ref.logp, mask), tol.logp),
        Stage(
            "advantages (max |Δ|)", _max_abs(ours.advantages, ref.advantages, mask), tol.advantages
        ),
        Stage("returns (max |Δ|)", _max_abs(ours.returns, ref.returns, mask), tol.advantages),
        Stage(
            "loss (|Δ| / max(|loss|, 1))",
            abs(ours.loss - ref.loss) / max(abs(ref.loss), 1.0),
            tol.loss,
            f"ours {ours.loss:.6g}, reference {ref.loss:.6g}",
        ),
        Stage("gradients (max rel. ||Δ||)", grads[worst][2], tol.grad, f"at {worst}"),
        Stage("weights after step (max |Δ|)", weights[worst_w], tol.weights, f"at {worst_w}"),
    ]


def format_grad_table(ours: dict, ref: dict | None = None) -> str:
    """Per-parameter gradient norms (and relative differences when ``ref`` is given)."""
    lines = []
    if ref is None:
        for name, g in ours.items():
            lines.append(f"  {name:<48} ||g|| {np.linalg.norm(g):.6e}")
        return "\n".join(lines)
    for name, (n_ours, n_ref, rel) in grad_differences(ours, ref).items():
        lines.append(f"  {name:<48} ||g|| {n_ours:.6e} ref {n_ref:.6e} rel.Δ {rel:.1e}")
    return "\n".join(lines)
