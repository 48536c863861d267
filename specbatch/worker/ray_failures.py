"""What went wrong in a round of calls to the tensor-parallel ranks, one clause per rank:
which rank, where it ran, and how it failed (its actor died, it raised, or it did not answer)."""

from __future__ import annotations

from typing import Any

FAILURE_GRACE_S = 2.0  # after one rank fails, how long to wait for the others' own errors


def describe_failures(refs: list[Any], locations: list[tuple[str, str, int]], pending: str) -> str:
    """One clause per rank whose call (``refs[rank]``) failed or, with ``pending`` (the text
    to give), has not answered within ``FAILURE_GRACE_S``. ``locations`` are the ranks'
    (node id, node ip, pid), as far as known."""
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=FAILURE_GRACE_S)
    done = set(ready)
    clauses = []
    for rank, ref in enumerate(refs):
        where = (
            f" (pid {locations[rank][2]} on {locations[rank][1]})" if rank < len(locations) else ""
        )
        if ref not in done:
            if pending:
                clauses.append(f"rank {rank}{where}: {pending}")
            continue
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            clauses.append(f"rank {rank}{where}: its actor process died")
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None) or e
            text = str(cause).strip().splitlines()
            first = text[0] if text else ""
            clauses.append(f"rank {rank}{where}: raised {type(cause).__name__}: {first}")
        except ray.exceptions.RayError as e:
            clauses.append(f"rank {rank}{where}: {type(e).__name__}")
    return "; ".join(clauses) or "unknown Ray error"
