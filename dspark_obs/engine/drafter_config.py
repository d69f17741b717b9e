"""The drafter's hyper-parameters and the target shapes they must agree with.

Embedding, final norm and LM head are the target's (shared, frozen), so the drafter's width,
vocabulary and head layout are derived from the target and checked against it on load.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def _tcfg(target: Any) -> Any:
    for name in ("cfg", "config"):
        c = getattr(target, name, None)
        if c is not None:
            return c
    raise ValueError("target has no .cfg/.config")


def _get(c: Any, *names: str) -> Any:
    for n in names:
        if hasattr(c, n):
            return getattr(c, n)
    raise ValueError(f"target config lacks any of {names}")


def target_signature(target: Any) -> dict[str, Any]:
    """The target shapes a drafter depends on (checked on load)."""
    c = _tcfg(target)
    return {
        "hidden_size": int(_get(c, "hidden_size", "d_model", "dim")),
        "vocab_size": int(_get(c, "vocab_size")),
        "num_layers": int(_get(c, "num_layers", "num_hidden_layers", "n_layers")),
    }


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters; the target-derived fields must match the target."""

    hidden_size: int = 576
    vocab_size: int = 49152
    target_num_layers: int = 30
    hidden_layers: tuple[int, ...] = (2, 15, 27)
    num_layers: int = 3
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    gamma_max: int = 7
    markov_rank: int = 32
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    context_window: int = 1024
    greedy_confidence: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_target(cls, target: Any, **overrides: Any) -> DrafterConfig:
        """Derive width/vocab/head layout from the target, so weights can be shared."""
        c = _tcfg(target)
        sig = target_signature(target)
        n = sig["num_layers"]
        kw: dict[str, Any] = {
            "hidden_size": sig["hidden_size"],
            "vocab_size": sig["vocab_size"],
            "target_num_layers": n,
            # low / middle / high layers, as in multi-layer feature drafters
            "hidden_layers": tuple(sorted({min(2, n - 1), n // 2, max(n - 3, 0)})),
            "num_heads": int(_get(c, "num_heads", "num_attention_heads", "n_heads")),
            "num_kv_heads": int(_get(c, "num_kv_heads", "num_key_value_heads", "n_kv_heads")),
            "intermediate_size": int(_get(c, "intermediate_size", "ffn_dim", "hidden_dim")),
        }
        kw["head_dim"] = int(getattr(c, "head_dim", 0) or sig["hidden_size"] // kw["num_heads"])
        for name, attrs in (
            ("rope_theta", ("rope_theta", "rope_base")),
            ("rms_eps", ("rms_norm_eps", "rms_eps", "norm_eps")),
        ):
            for a in attrs:
                if getattr(c, a, None) is not None:
                    kw[name] = float(getattr(c, a))
                    break
        kw.update(overrides)
        kw["hidden_layers"] = tuple(int(x) for x in kw["hidden_layers"])
        return cls(**kw)

    def check_target(self, target: Any) -> None:
        """Raise ValueError naming every shape this config and ``target`` disagree on."""
        sig = target_signature(target)
        mism = [
            f"{k}: drafter {getattr(self, ck)} != target {sig[k]}"
            for k, ck in (
                ("hidden_size", "hidden_size"),
                ("vocab_size", "vocab_size"),
                ("num_layers", "target_num_layers"),
            )
            if getattr(self, ck) != sig[k]
        ]
        if any(layer >= sig["num_layers"] or layer < 0 for layer in self.hidden_layers):
            mism.append(f"hidden_layers {self.hidden_layers} outside target's {sig['num_layers']}")
        if mism:
            raise ValueError("drafter/target shape mismatch: " + "; ".join(mism))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["hidden_layers"] = list(self.hidden_layers)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DrafterConfig:
        d = dict(d)
        d["hidden_layers"] = tuple(d["hidden_layers"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})
