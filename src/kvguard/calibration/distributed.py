"""Where calibration's parallel work runs: in this process, or spread over Ray workers.

Three stages of ``kvguard calibrate`` are many independent pieces of work on one model:

- **statistics** — the forward passes of one calibration batch
  (:func:`kvguard.calibration.kv_statistics.collect_batch`);
- **sensitivity** — one held-out score per layer / KV-head trial (:func:`kvguard.calibration.sensitivity.measure`);
- **search** — one held-out score per candidate plan (:class:`kvguard.calibration.search.Searcher`).

An executor runs such a list and yields the results **in input order**; the stages merge them the same way
whichever executor ran them, so a distributed run equals a single-process one bit for bit. The
:class:`LocalExecutor` runs each item here, one after another. The :class:`RayExecutor` starts ``workers``
Ray actors that each load the model once (by name or folder, so the weights never travel), receive the
held-out slice with its FP16 reference once (``ray.put``), and then take batches or plans one at a time.
``docs/scaling.md`` describes what moves where and how it scales.

Ray is optional (``pip install kvguard[ray]``) and imported only when a :class:`RayExecutor` is made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvguard import models
from kvguard.calibration.heldout import HeldOut, Reference
from kvguard.profile import PlanScore
from kvguard.plan import Plan, StaticScales
from kvguard.calibration.kv_statistics import BatchStatistics, collect_batch

RAY_INSTALL_HINT = "pip install 'kvguard[ray]'  (or: pip install ray==2.60.0; in a checkout of kvguard: make ray)"


class RayUnavailableError(ImportError):
    """``--ray`` was asked for but Ray is not installed."""


def require_ray():
    """The ``ray`` module, or a :class:`RayUnavailableError` that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise RayUnavailableError(f"distributed calibration (--ray) needs Ray, which is not installed; "
                                  f"install it with: {RAY_INSTALL_HINT}") from err
    return ray


class Executor(Protocol):
    """Runs the parallel pieces of calibration; every method yields results in input order."""

    workers: int

    def statistics(self, batches: Sequence[torch.Tensor]) -> Iterator[BatchStatistics]:
        """One :class:`~kvguard.calibration.kv_statistics.BatchStatistics` per ``[B, T]`` batch."""

    def score(self, heldout: HeldOut, plans: Sequence[Plan], scales: StaticScales | None = None,
              anchors: Sequence[Plan] = ()) -> Iterator[PlanScore]:
        """``heldout.score(plan, scales, anchors)`` for every plan."""

    def close(self) -> None:
        """Release the workers."""


class Worker:
    """One process's share of the work: a model, and the held-out slice once it has been sent."""

    def __init__(self, model, heldout: HeldOut | None = None) -> None:
        self.model = model
        self.heldout = heldout

    def collect_batch(self, ids: torch.Tensor) -> BatchStatistics:
        return collect_batch(self.model, ids)

    def use_heldout(self, streams: dict[str, torch.Tensor], reference: Reference) -> None:
        self.heldout = HeldOut(self.model, streams, reference)

    def score(self, plan: Plan, scales: StaticScales | None, anchors: Sequence[Plan] = ()) -> PlanScore:
        if self.heldout is None:
            raise RuntimeError("this worker has no held-out slice yet (use_heldout first)")
        return self.heldout.score(plan, scales, anchors)


class LocalExecutor:
    """Everything in this process, in order: the single-process run that a distributed one must equal."""

    workers = 1

    def __init__(self, model) -> None:
        self.model = model

    def statistics(self, batches: Sequence[torch.Tensor]) -> Iterator[BatchStatistics]:
        worker = Worker(self.model)
        for ids in batches:
            yield worker.collect_batch(ids)

    def score(self, heldout: HeldOut, plans: Sequence[Plan], scales: StaticScales | None = None,
              anchors: Sequence[Plan] = ()) -> Iterator[PlanScore]:
        worker = Worker(self.model, heldout)
        for plan in plans:
            yield worker.score(plan, scales, anchors)

    def close(self) -> None:
        pass

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class RayConfig:
    """Where and how wide to run on Ray.

    Attributes:
        address: ``"local"`` starts a private Ray on this machine; anything else goes to ``ray.init(address=...)``
            (``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``). An already initialised Ray is used as is.
        workers: actors, each holding one copy of the model; ``None``: the cluster's CPUs / ``threads``.
        threads: torch intra-op threads (and Ray CPUs) per worker.
    """

    address: str = "local"
    workers: int | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("the Ray address must be 'local', 'auto', HOST:PORT or ray://HOST:PORT, got an empty string")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers}")
        if self.threads < 1:
            raise ValueError(f"threads must be a positive integer, got {self.threads}")


class _RayWorker(Worker):
    """The body of one Ray actor: loads the model itself, once."""

    def __init__(self, model_name: str, threads: int) -> None:
        # Ray sets OMP_NUM_THREADS in its workers from its own CPU accounting; set torch's count explicitly.
        torch.set_num_threads(threads)
        model, _ = models.load(model_name, settle_heap=False)  # no KV cache here (kvguard.models.load)
        super().__init__(model)

    def describe(self) -> dict:
        import ray

        import kvguard

        return {"fingerprint": models.fingerprint(self.model), "kvguard": os.path.dirname(kvguard.__file__),
                "version": kvguard.__version__, "threads": torch.get_num_threads(),
                "node": ray.util.get_node_ip_address(), "pid": os.getpid()}


class RayExecutor:
    """Ray actors that each hold the model; batches and plans go to whichever actor is free.

    ``model`` is the driver's copy: every worker's fingerprint must equal its fingerprint. Construction
    returns once every worker has loaded its model (so nothing else competes for the CPUs afterwards, e.g.
    with the latency measurement)."""

    def __init__(self, model_name: str, model, config: RayConfig = RayConfig(), *, log=None) -> None:
        ray = require_ray()
        from ray.util import ActorPool

        self.config = config
        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if config.address == "local":
                # Workers on this machine import the same kvguard as this process, wherever it lives.
                package_root = os.path.dirname(os.path.dirname(os.path.abspath(models.__file__)))
                path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
                ray.init(address="local", include_dashboard=False, log_to_driver=False,
                         num_cpus=None if config.workers is None else config.workers * config.threads,
                         runtime_env={"env_vars": {"PYTHONPATH": path}})
            else:
                ray.init(address=config.address, log_to_driver=False)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        self.workers = config.workers or max(1, cpus // config.threads)
        if self.workers * config.threads > cpus and log is not None:
            log(f"ray: warning: {self.workers} workers x {config.threads} thread(s) need {self.workers * config.threads} "
                f"CPUs, the cluster has {cpus}; the rest wait until it has them")
        actor = ray.remote(num_cpus=config.threads)(_RayWorker)
        self.actors = [actor.remote(model_name, config.threads) for _ in range(self.workers)]
        self._pool = ActorPool(self.actors)
        self._heldout: HeldOut | None = None
        try:
            self.described = ray.get([a.describe.remote() for a in self.actors])
        except BaseException:
            self.close()
            raise
        want = models.fingerprint(model)
        wrong = [d for d in self.described if d["fingerprint"] != want]
        if wrong:
            self.close()
            raise ValueError(f"Ray worker on {wrong[0]['node']} loaded {model_name!r} with fingerprint "
                             f"{wrong[0]['fingerprint'][:19]}..., this process has {want[:19]}...: every node needs "
                             "the same model files")
        if log is not None:
            nodes = sorted({d["node"] for d in self.described})
            log(f"ray: {self.workers} worker(s) x {config.threads} thread(s) on {len(nodes)} node(s) "
                f"({', '.join(nodes)}); kvguard {self.described[0]['version']} from {self.described[0]['kvguard']}")

    def _map(self, method: str, args: Sequence[tuple]) -> Iterator:
        # ActorPool.map yields results in submission order, whichever actor finished first.
        return self._pool.map(lambda actor, a: getattr(actor, method).remote(*a), list(args))

    def statistics(self, batches: Sequence[torch.Tensor]) -> Iterator[BatchStatistics]:
        return self._map("collect_batch", [(ids,) for ids in batches])

    def score(self, heldout: HeldOut, plans: Sequence[Plan], scales: StaticScales | None = None,
              anchors: Sequence[Plan] = ()) -> Iterator[PlanScore]:
        ray = self._ray
        if self._heldout is not heldout:
            # Once per held-out slice: the streams and the FP16 reference (tokens x vocab floats per domain).
            streams, reference = ray.put(heldout.streams), ray.put(heldout.reference)
            ray.get([a.use_heldout.remote(streams, reference) for a in self.actors])
            self._heldout = heldout
        # Each worker records its own pass under each anchor, once (a hidden state per layer: never sent).
        scales_ref, anchors_ref = ray.put(scales), ray.put(tuple(anchors))
        return self._map("score", [(plan, scales_ref, anchors_ref) for plan in plans])

    def close(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors = []
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_executor(model_name: str, model, ray: RayConfig | None = None, *, log=None) -> LocalExecutor | RayExecutor:
    """The :class:`LocalExecutor` over ``model``, or a :class:`RayExecutor` when ``ray`` is given."""
    if ray is None:
        return LocalExecutor(model)
    return RayExecutor(model_name, model, ray, log=log)
