"""The PyTorch reference of one update: transformers' model and verl's formulas, in torch.

Used by the tests and by ``jaxrl-tools repro --torch``; torch is imported only when a function
here runs (it is not a dependency of the package). The formulas are transcribed from verl's
``core_algos.py`` (``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``, ``compute_gae_advantage_return``,
``compute_policy_loss_vanilla``, ``kl_penalty``, ``agg_loss``) and ``torch_functional.py``
(``masked_whiten``, ``entropy_from_logits``), written here on plain tensors, with verl's loops
and its dict-of-groups by ``uid``, so that nothing is shared with the JAX side but the batch.
"""

from __future__ import annotations

import numpy as np

from jaxrl_tools.config import ConfigError
from jaxrl_tools.interop.batch import check_batch, token_level_rewards
from jaxrl_tools.interop.update import REFERENCE_ESTIMATORS, UpdateResult, UpdateSettings


def _torch():
    try:
        import torch  # noqa: PLC0415  (optional: only the reference side needs it)
        import transformers  # noqa: PLC0415
    except ImportError:
        raise ConfigError(
            "the PyTorch reference needs torch: pip install torch (the CPU build is enough)"
        ) from None
    return torch, transformers


def load_model(model_dir: str, dtype: str = "float32"):
    """The HF checkpoint as a transformers model, eager attention, no dropout."""
    torch, transformers = _torch()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    return model.eval()  # eval: no dropout; gradients still flow


def _masked_mean(torch, x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def _masked_whiten(torch, x, m):
    mean = _masked_mean(torch, x, m)
    var = _masked_mean(torch, (x - mean) ** 2, m)
    n = m.sum()
    var = var * n / (n - 1)  # unbiased, as verl
    return (x - mean) * torch.rsqrt(var + 1e-8)


def advantages(batch: dict[str, np.ndarray], settings: UpdateSettings):
    """verl's estimators on [B, R] tensors: (advantages, returns)."""
    torch, _ = _torch()
    a = settings.algorithm
    name = a.adv_estimator
    if name not in REFERENCE_ESTIMATORS:
        raise ConfigError(
            f"the PyTorch reference has no adv_estimator={name!r}; it has {REFERENCE_ESTIMATORS}"
        )
    rewards = torch.tensor(token_level_rewards(batch))
    mask = torch.tensor(batch["response_mask"], dtype=torch.float32)
    if name == "gae":
        values = torch.tensor(np.asarray(batch["values"], np.float32))
        gamma, lam = a.gamma, a.lam
        next_value, last_gae, out = 0.0, 0.0, []
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            # observation tokens pass the next model token's value and advantage through
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
            out.append(last_gae)
        adv = torch.stack(out[::-1], dim=1)
        return _masked_whiten(torch, adv, mask), adv + values
    scores = rewards.sum(dim=-1)
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(batch["uid"].tolist()):
        groups.setdefault(uid, []).append(i)
    out = scores.clone()
    for rows in groups.values():
        s = scores[rows]
        n = len(rows)
        mean = s.mean() if n > 1 else torch.tensor(0.0)
        if name in ("grpo", "drgrpo"):
            std = s.std() if n > 1 else torch.tensor(1.0)
            by_std = a.norm_adv_by_std and name == "grpo"
            out[rows] = (s - mean) / (std + 1e-6) if by_std else s - mean
        elif name == "rloo":
            out[rows] = s * n / (n - 1) - mean * n / (n - 1) if n > 1 else s
        else:  # reinforce_pp_baseline
            out[rows] = s - mean
    adv = out[:, None] * mask
    if name == "reinforce_pp_baseline":
        adv = _masked_whiten(torch, adv, mask) * mask
    return adv, adv


def _kl(torch, logp, ref_logp, kl_type):
    d = ref_logp - logp
    if kl_type in ("kl", "k1"):
        return -d
    if kl_type in ("mse", "k2"):
        return 0.5 * d.square()
    if kl_type in ("abs",):
        return d.abs()
    d = torch.clamp(d, -20, 20)  # low_var_kl / k3
    return torch.clamp(torch.exp(d) - d - 1, -10, 10)


def agg_loss(torch, loss, mask, mode):
    """verl's agg_loss, on one rank and one micro-batch."""
    if mode == "token-mean":
        return _masked_mean(torch, loss, mask)
    per_row = (loss * mask).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return per_row.mean()
    if mode == "seq-mean-token-mean":
        return (per_row / mask.sum(dim=-1)).mean()
    return per_row.sum() / mask.shape[-1]  # seq-mean-token-sum-norm


def torch_update(model, batch: dict[str, np.ndarray], settings: UpdateSettings) -> UpdateResult:
    """One update in PyTorch; ``model`` is updated in place (``load_model`` gives a fresh one)."""
    torch, _ = _torch()
    _, P, _ = check_batch(batch)
    s, o = settings.algorithm, settings.optim
    ids = torch.tensor(batch["input_ids"], dtype=torch.long)
    logits = model(
        input_ids=ids,
        attention_mask=torch.tensor(batch["attention_mask"], dtype=torch.long),
        position_ids=torch.tensor(batch["position_ids"], dtype=torch.long),
        use_cache=False,
    ).logits
    logits = logits[:, P - 1 : -1].float() / settings.temperature  # position t predicts token t + 1
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, P:, None])[..., 0]
    mask = torch.tensor(batch["response_mask"], dtype=torch.float32)
    adv, ret = advantages(batch, settings)
    old = (
        torch.tensor(np.asarray(batch["old_log_probs"], np.float32))
        if "old_log_probs" in batch
        else logp.detach()
    )
    log_ratio = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - s.clip_eps_low, 1 + s.clip_eps_high)
    pg = torch.maximum(loss1, loss2)
    if s.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(-adv * s.dual_clip, pg), pg)
    loss = agg_loss(torch, pg, mask, s.loss_agg_mode)
    if s.entropy_coef:
        entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
        loss = loss - s.entropy_coef * agg_loss(torch, entropy, mask, s.loss_agg_mode)
    if s.kl_coef:
        ref = torch.tensor(np.asarray(batch["ref_log_prob"], np.float32))
        kl = _kl(torch, logp, ref, s.kl_type)
        loss = loss + s.kl_coef * agg_loss(torch, kl, mask, s.loss_agg_mode)
    model.zero_grad()
    loss.backward()
    named = dict(model.named_parameters())
    grads = {n: p.grad.detach().float().numpy().copy() for n, p in named.items()}
    if o.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay
    )
    opt.step()
    params = {n: p.detach().float().numpy().copy() for n, p in named.items()}
    return UpdateResult(
        logp=(logp * mask).detach().numpy(),
        advantages=(adv * mask).numpy(),
        returns=(ret * mask).numpy(),
        loss=loss.item(),
        grads=grads,
        params=params,
    )
