"""The estimate's efficiency constants fitted from a measured sweep (`--sweep --fit OUT.json`), and
read back (`--efficiency OUT.json`).

The estimate of a step is `compute/matmul + exposed/link + max(0, overlapped/link − compute/matmul)`,
where `compute`, `exposed` and `overlapped` are its terms at full efficiency (`estimate` with
`Efficiency(1, 1)`); `fit` finds the matmul and link efficiencies whose estimates come closest to
the measured step times.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from jaxllm.errors import JaxllmError
from jaxllm.plan.hardware import DEFAULT_EFFICIENCY, Efficiency

TERMS = ("compute_s", "exposed_s", "overlapped_s")  # a row's terms at full efficiency


class FitError(JaxllmError):
    """Too few measured layouts to fit from, or an efficiency file that cannot be read."""


def predict(terms: Mapping[str, float], efficiency: Efficiency) -> float:
    """The estimate's step time from its full-efficiency terms (as `Estimate.step` computes it)."""
    compute = terms["compute_s"] / efficiency.matmul
    return compute + terms["exposed_s"] / efficiency.link + max(0.0, terms["overlapped_s"] / efficiency.link - compute)


def _scale(f: np.ndarray, measured: np.ndarray) -> float:
    """The least-squares factor k of the relative error of k·f against `measured`."""
    f, m = f / measured, np.ones_like(measured)
    return float(f @ m / (f @ f)) if f.any() else math.nan


def fit(rows: Sequence[Mapping[str, float]], start: Efficiency = DEFAULT_EFFICIENCY) -> tuple[Efficiency, float]:
    """(the efficiencies that best predict each row's `measured_step_s` from its `TERMS`, least
    squares of the relative error; the rms relative error of those predictions). An efficiency the
    rows cannot tell keeps `start`'s value: the link's without communication in any row, the
    matmuls' where every row's overlapped transfers outlast its compute.

    With x = 1/matmul and y = 1/link, a row's prediction is linear in (x, y) on either side of the
    ray y/x = compute/overlapped, where its overlapped transfers stop hiding behind compute. So the
    best fit is the best of: the unconstrained solution between each two neighbouring rays (where
    it falls between them), and the best x on each ray."""
    keys = (*TERMS, "measured_step_s")
    rows = [r for r in rows if all(math.isfinite(r[k]) for k in keys) and r["measured_step_s"] > 0]
    if not rows:
        raise FitError("no measured layouts to fit the efficiencies from")
    c, e, o, measured = (np.array([r[k] for r in rows], dtype=float) for k in keys)

    def error(x: float, y: float) -> float:
        return float(np.sum(((c * x + e * y + np.maximum(0.0, o * y - c * x)) / measured - 1) ** 2))

    if not (e.any() or o.any()):  # nothing tells the link's efficiency
        y = 1 / start.link
        candidates = [(_scale(c, measured), y)]
    else:
        rays = sorted({float(ci / oi) for ci, oi in zip(c, o, strict=True) if oi > 0 and ci > 0})
        candidates = [(x, ratio * x) for ratio in rays
                      for x in [_scale(c + ratio * e + np.maximum(0.0, ratio * o - c), measured)]]  # fmt: skip
        edges = [0.0, *rays, math.inf]
        for low, high in zip(edges, edges[1:], strict=False):
            inside = (low + high) / 2 if math.isfinite(high) else max(2 * low, 1.0)
            hidden = o * inside <= c  # the regime of each row between these rays
            columns = np.stack([np.where(hidden, c, 0.0), np.where(hidden, e, e + o)], axis=1) / measured[:, None]
            (x, y), *_ = np.linalg.lstsq(columns, np.ones_like(measured), rcond=None)
            if x > 0 and y > 0 and low <= y / x <= high:
                candidates.append((float(x), float(y)))
    candidates = [(x, y) for x, y in candidates if x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)]
    if not candidates:
        raise FitError("the measured step times fit no positive efficiencies; see the sweep's table")
    x, y = min(candidates, key=lambda xy: error(*xy))
    # Every step waits on transfers, whatever the matmuls' speed (a fit on a ray has a row exactly
    # at the edge, where it still waits):
    if not (o * y < c * x * (1 - 1e-9)).any():
        x = 1 / start.matmul
    fitted = Efficiency(1 / x, 1 / y, "a sweep")
    return fitted, math.sqrt(error(x, y) / len(rows))


def save(path: str | pathlib.Path, efficiency: Efficiency, error: float, table: list[dict], about: dict) -> None:
    """Writes the fitted efficiencies with the sweep table they were fitted from."""
    doc = {
        "matmul_efficiency": efficiency.matmul,
        "link_efficiency": efficiency.link,
        "rms_relative_error": error,
        "fitted_on": about,
        "table": table,
    }
    pathlib.Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load(path: str | pathlib.Path) -> Efficiency:
    """The efficiencies of a file `save` wrote."""
    try:
        doc = json.loads(pathlib.Path(path).read_text())
        matmul, link = float(doc["matmul_efficiency"]), float(doc["link_efficiency"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FitError(f"cannot read efficiencies from {path}: {e}") from e
    if not (matmul > 0 and link > 0):
        raise FitError(f"{path}: efficiencies must be positive, got matmul {matmul}, link {link}")
    about = doc.get("fitted_on", {})
    measured = sum(1 for row in doc.get("table", []) if row.get("measured"))
    where = f"{about.get('backend', '?')} ({about.get('device_kind', '?')}), {measured} layouts measured"
    return Efficiency(matmul, link, f"{path}, measured on {where}")
