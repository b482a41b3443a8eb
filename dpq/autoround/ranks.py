"""What auto-round does once per job: its save, written whole or not at all, and under several
processes (torchrun) by rank 0 alone.

Six replacements in the patch table (:mod:`.patches`), each handed its run (Note [each replacement
is handed its run] there; None: no ``enable()``) and passing straight through when that run holds
no process set (:attr:`dpq.autoround.run.Run.processes`), but the first, which needs only dpq on:

* ``BaseCompressor.quantize_and_save``: the run writes its output into a folder beside
  ``output_dir`` and moves it into place only once the whole save succeeded
  (:class:`dpq.staging.Staging`); a failed or cancelled run leaves ``output_dir`` exactly as it
  was (a model saved there before is untouched). Under several processes rank 0 does this.
* ``BaseCompressor.save_quantized``: every rank waits for every other first (a barrier on the
  run's group, bounded by the group's timeout), so that rank 0 never finishes a save after a
  failure on another rank (a rank that failed raised, or was killed: the barrier fails and
  :meth:`dpq.planning.distributed.ProcessSet.stop` names it); then rank 0 writes and the other ranks
  write nothing (their model stays in memory, quantized the same way) and wait for the folders
  rank 0 wrote, once they are in place: as long as the save takes, not bounded by the group's
  timeout, but by rank 0's heartbeat (a rank 0 that died is noticed; one that saves slowly is
  waited for). With auto-round's immediate saving (its default for this format) rank 0's
  weights are written during quantization (into the staging folder); the configs
  (``config.json``, ``quantization_config.json``) only here, after the barrier.
* ``MLLMMixin.save_quantized`` and ``DiffusionMixin.save_quantized``: auto-round's MLLM and
  diffusion compressors override the save (the diffusion one writes the pipeline's other
  components and ``model_index.json`` itself), so they get the same treatment: the barrier,
  then rank 0 runs the whole override; its ``super().save_quantized`` inside is part of that
  save (no second barrier), and the other ranks write nothing.
* ``BaseCompressor._adjust_immediate_packing_and_saving``: on ranks other than 0, no immediate
  saving (auto-round's ``low_cpu_mem_usage`` writes shards into ``--output_dir`` *during*
  quantization): those ranks keep the packed blocks in memory instead.
* ``setup_ddp_if_needed_`` (auto-round's own DDP lane, which ``SignRoundQuantizer.quantize_block``
  enters whenever a group is initialised): never on dpq's path. A block the ranks agreed to run
  serially (``dpq.planning.distributed.agree``) runs auto-round's serial loop alone on every rank, the
  same way on the same inputs and seed; with ``--parallel_quantization off`` (``enable('off')``)
  auto-round's own code runs unchanged (contract 5), its DDP lane included.
"""

from __future__ import annotations

import errno
import os

from dpq.staging import Staging

from . import patches
from .run import Run

__all__ = ["SaveFailed", "adjust_immediate_packing_and_saving", "diffusion_save_quantized", "mllm_save_quantized",
           "quantize_and_save", "save_quantized", "setup_ddp_if_needed_"]


class SaveFailed(RuntimeError):
    """Writing the model failed (:func:`is_write_failure`); the staging folder is gone, so
    ``--output_dir`` is as it was. The message says so, with the fix; the report's ``where`` is
    "save"."""

    def __init__(self, output_dir: str, err: BaseException, staged: bool = True) -> None:
        from dpq import refusals

        super().__init__(f"dpq: {refusals.save_failed(str(output_dir), _said(err), staged)}")


# errno values only a write produces: no space, over quota, a file too large, a read-only file system
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
_WRITE_WORDS = tuple(os.strerror(e) for e in sorted(_WRITE_ERRNOS))  # as Rust's io::Error says them too


def is_write_failure(err: BaseException) -> bool:
    """Whether ``err`` is a write that failed for want of room or permission to write: an ``OSError``
    of :data:`_WRITE_ERRNOS`, or safetensors' own error (raised by its Rust writer, which auto-round's
    immediate saving calls while blocks are still quantized) saying the same. A read that fails (a
    missing dataset file) is not one."""
    if isinstance(err, OSError):
        return err.errno in _WRITE_ERRNOS
    return type(err).__name__ == "SafetensorError" and any(words in str(err) for words in _WRITE_WORDS)


def _said(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _original(owner: str, name: str):
    import importlib

    module, _, attr = owner.partition(":")
    obj = importlib.import_module(module)
    return patches.original(getattr(obj, attr) if attr else obj, name)


_BASE = "auto_round.compressors.base:BaseCompressor"
_MLLM = "auto_round.compressors.mllm_mixin:MLLMMixin"
_DIFFUSION = "auto_round.compressors.diffusion_mixin:DiffusionMixin"
_SR_MODULE = "auto_round.algorithms.quantization.sign_round.quantizer"


def save_quantized(run: Run | None, self, output_dir=None, format=None, inplace=True, return_folders=False,
                   max_shard_size=None, **kwargs):
    return _rank0_writes(run, _BASE, self, output_dir, format, inplace, return_folders, max_shard_size=max_shard_size,
                         **kwargs)


def mllm_save_quantized(run: Run | None, self, output_dir=None, format="auto_round", inplace=True, **kwargs):
    return_folders = kwargs.pop("return_folders", False)  # MLLMMixin hands it on to BaseCompressor in **kwargs
    return _rank0_writes(run, _MLLM, self, output_dir, format, inplace, return_folders, **kwargs)


def diffusion_save_quantized(run: Run | None, self, output_dir=None, format=None, inplace=True, return_folders=False,
                             **kwargs):
    return _rank0_writes(run, _DIFFUSION, self, output_dir, format, inplace, return_folders, **kwargs)


def quantize_and_save(run: Run | None, self, output_dir="tmp_autoround", format=None, inplace=True, max_shard_size=None,
                      **kwargs):
    """auto-round's ``quantize_and_save`` with its output written whole or not at all
    (:class:`dpq.staging.Staging`): the whole run (auto-round's immediate saving writes shards during
    quantization) writes into a folder beside ``output_dir``, moved into place once the save
    succeeded; on failure or cancel ``output_dir`` is left as it was. Under several processes rank 0
    stages (the others write nothing) and hands the others the folders once they are in place.
    Passes straight through with dpq off, or with auto-round's resume (``AR_RESUME_DIR``: it reuses a
    failed run's shards in ``output_dir``, so they must stay there)."""
    from auto_round.logger import logger

    from dpq import refusals
    from dpq.planning.distributed import RankFailure, peer_lost
    from dpq.planning.plan import PlanRefused

    original = _original(_BASE, "quantize_and_save")
    procs = run.processes if run is not None else None
    if run is None or run.world == "off" or (procs is not None and procs.rank != 0):
        return original(self, output_dir, format, inplace, max_shard_size, **kwargs)
    if os.environ.get("AR_RESUME_DIR"):
        logger.warning(f"dpq: {refusals.UNSTAGED_FOR_RESUME}")
        return original(self, output_dir, format, inplace, max_shard_size, **kwargs)
    staging = run.staging = Staging(output_dir)
    if staging.leftovers:
        logger.warning(f"dpq: {refusals.staging_leftovers([str(p) for p in staging.leftovers])}")
    if staging.removed:
        logger.info(f"dpq: removed the empty staging folders of killed runs: {', '.join(map(str, staging.removed))}")
    try:
        model, folders = original(self, str(staging.dir), format, inplace, max_shard_size, **kwargs)
        staging.commit()
    except BaseException as err:
        staging.discard()
        if is_write_failure(err):  # said as what it is, once the staging is gone
            run.at = "save"
            failed = SaveFailed(output_dir, err)
            failed.__cause__ = err
            err = failed
        agreed = isinstance(err, RankFailure) or (isinstance(err, PlanRefused) and err.every_rank)  # every rank knows
        if procs is not None and not agreed:  # the others wait for this rank's move
            failure = procs.stop(err, peer_lost(err))
            if isinstance(err, Exception):
                raise failure from err
        if isinstance(err, SaveFailed):
            raise err from err.__cause__
        raise
    finally:
        run.staging = None
    folders = [staging.path_in_place(f) for f in folders] if isinstance(folders, list) else \
        staging.path_in_place(folders)
    self.output_dir = self.compress_context.output_dir = staging.path_in_place(self.output_dir)
    if staging.dropped:
        logger.info(f"dpq: removed the earlier model's weight files the new one does not have: "
                    f"{', '.join(map(str, staging.dropped))}")
    logger.info(f"dpq: the saved model is complete and in place: {folders}")
    if procs is not None:
        procs.publish("save", folders)
    return model, folders


def _rank0_writes(run: Run | None, owner: str, self, output_dir, format, inplace, return_folders, **kwargs):
    """``owner.save_quantized`` under several processes: the barrier, rank 0 writes, every rank returns
    rank 0's folders (module docstring). A save called from inside rank 0's save (a mixin's
    ``super().save_quantized``) is part of it: it passes straight through, with no second barrier.
    The other ranks wait for rank 0's folders without a collective deadline (a save can take long):
    on its heartbeat (:meth:`dpq.planning.distributed.ProcessSet.await_rank0`), until rank 0 hands them out:
    after this save, or, inside :func:`quantize_and_save`, once they are moved into place."""
    procs = run.processes if run is not None else None
    save = _original(owner, "save_quantized")
    if run is not None:
        run.at = "save"  # a failure from here on stopped in the save (the report's "where")
    if procs is None or run is None or run.rank0_saving:
        return save(self, output_dir, format, inplace, return_folders=return_folders, **kwargs)
    import torch.distributed as dist

    from dpq.planning.distributed import peer_lost

    out = None
    try:
        dist.barrier(group=procs.group)  # every rank got here: none failed after its last collective
        if procs.rank == 0:
            procs.beat("save")
            run.rank0_saving = True
            try:
                out = save(self, output_dir, format, inplace, return_folders=True, **kwargs)
            finally:
                run.rank0_saving = False
            folders = out[1]
            if run.staging is None:
                procs.publish("save", folders)
        else:
            from auto_round.logger import logger

            logger.info(f"dpq: rank {procs.name(procs.rank)} writes nothing: rank 0 writes the model")
            folders = procs.await_rank0("save")  # every rank returns rank 0's folders (auto-round's CLI probes them)
    except Exception as err:
        raise procs.stop(err, peer_lost(err)) from err
    model = out[0] if out else self.model
    return (model, folders) if return_folders else model


def adjust_immediate_packing_and_saving(run: Run | None, self):
    _original(_BASE, "_adjust_immediate_packing_and_saving")(self)
    procs = run.processes if run is not None else None
    if procs is not None and procs.rank != 0:
        self.compress_context.is_immediate_saving = False  # only rank 0 writes --output_dir


def setup_ddp_if_needed_(run: Run | None, ar, block, device_list):
    if run is None or run.world == "off":
        return _original(_SR_MODULE, "setup_ddp_if_needed_")(ar, block, device_list)
    return block, _no_sync


def _no_sync() -> None:
    """dpq's serial block under several processes: every rank tunes alone, the same way."""
