"""Checkpoints of a training run: DeepSpeed tags under run_dir/checkpoints/, one component for the loop.

A tag `step<N>` holds the engine's state (model, optimizer, scheduler) and, per rank, the client state a resume
needs to continue bit-exactly: the stream position, the RNG states, the sample and token counters, the
metrics window's partial sums and the health alarms' reference loss (engine/health.py). Its copy
of the run's config is written last, the mark of a complete tag; `latest` moves to it only after that, so a
crash while saving leaves the previous checkpoint in charge (docs/design.md, "Run directory").

Loading takes three ways (`Checkpointer.load`): the run's own tag at the same world size (every rank its own
position and RNGs), a universal tag at another world size (`pretrieve universal`: ranks ran in lockstep, so any
rank's position is all's), or a branch, another run's tag whose schedule starts at that step (`init_checkpoint`).
"""

from __future__ import annotations

import errno
import shutil
import sys
from pathlib import Path

import torch

from pretrieve.engine.lr_schedule import start_at
from pretrieve.engine.rng import rng_state, seed_everything, set_rng_state
from pretrieve.utils.run_dir import LATEST, TAG_CONFIG, latest_checkpoint, step_of, tag_of, write_atomic


class Checkpointer:
    """Saves and loads the checkpoints of one run for one rank; `position` is the loader's position (the job's
    `position`: state_dict, load_state_dict and describe_position), `metrics` the metrics window (state_dict,
    load_state_dict, merged), `health` the alarms (state_dict, load_state_dict); `options` the run's
    `checkpoint` section (every, keep)."""

    def __init__(self, engine, ckpt_dir: Path, position, options, rank: int, world: int, config_yaml: str,
                 metrics=None, health=None):
        self.engine, self.ckpt_dir, self.position, self.options = engine, ckpt_dir, position, options
        self.rank, self.world, self.config_yaml, self.metrics = rank, world, config_yaml, metrics
        self.health = health

    def save(self, step: int, counters: dict) -> str:
        """Save tag `step<N>` (its config last, the mark of a complete tag), then point `latest` at it, then drop
        all but the newest `keep` tags. A failed save (a full disk) names the tag and leaves `latest` as it was."""
        import torch.distributed as dist

        tag = tag_of(step)
        if self.rank == 0:  # what a crashed attempt left of this tag (never `latest`: that moves only after a save);
            shutil.rmtree(self.ckpt_dir / tag, ignore_errors=True)  # the all_gather below holds the others back
        mine = {"stream": self.position.state_dict(), "rng": rng_state(), "counters": dict(counters)}
        if self.metrics is not None:
            mine["metrics"] = self.metrics.state_dict()
        if self.health is not None:
            mine["health"] = self.health.state_dict()
        every = [mine] if self.world == 1 else [None] * self.world  # DeepSpeed saves client state from rank 0 only
        if self.world > 1:
            dist.all_gather_object(every, mine)
        try:
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, save_latest=False,
                                        client_state={key: [s[key] for s in every] for key in mine})
            if self.world > 1:
                dist.barrier()
            if self.rank == 0:
                write_atomic(self.ckpt_dir / tag / TAG_CONFIG, self.config_yaml)
        except (OSError, RuntimeError) as e:
            raise _save_failed(self.ckpt_dir, tag, e) from e
        if self.rank == 0:
            write_atomic(self.ckpt_dir / LATEST, tag)
            prune_tags(self.ckpt_dir, tag, self.options.keep, self.options.every)
        return tag

    def load(self, folder: Path, tag: str, branch: bool, seed: int) -> dict:
        """Restores the engine, the data position and the RNGs from tag `tag` of checkpoints `folder`; returns
        the sample and token counters this rank continues from. Rank 0 says where the run goes on."""
        import torch.distributed as dist

        from pretrieve.engine.universal import is_universal

        rank, world = self.rank, self.world
        if is_universal(folder / tag):
            if rank == 0:
                rename_old_parameters(self.engine.module, folder / tag)
            if world > 1:
                dist.barrier()
        _, client = self.engine.load_checkpoint(str(folder), tag=tag, load_lr_scheduler_states=not branch)
        if client is None:
            raise RuntimeError(f"{folder / tag}: DeepSpeed could not load this checkpoint (see its log above)")
        # this config's schedule from the checkpoint's step: the lr the checkpoint holds when train.max_steps is
        # the same; with a longer one (a run extended) not the old schedule's, 0 at its end (the zero_lr alarm);
        # a branch's own schedule
        start_at(self.engine.lr_scheduler, self.engine.global_steps)
        # the metrics window of an interval the checkpoint cut (checkpoints before it was kept have none); a
        # branch is a run of its own, whose first window starts with it
        windows = client.get("metrics") if self.metrics is not None and not branch else None
        if self.health is not None and client.get("health"):  # the same on every rank; a branch's too
            self.health.load_state_dict(client["health"][0])
        if len(client["stream"]) == world:
            self.position.load_state_dict(client["stream"][rank])
            set_rng_state(client["rng"][rank], f"{folder / tag}")
            counters = client["counters"][rank]
            if windows:
                self.metrics.load_state_dict(windows[rank])
        else:  # another world size (universal checkpoint): ranks ran in lockstep, any rank's position is all's
            self.position.load_state_dict(client["stream"][0])
            seed_everything(seed + self.engine.global_steps + rank)
            counters = {key: sum(c[key] for c in client["counters"]) if rank == 0 else 0  # the run's totals so far
                        for key in ("samples", "tokens")}
            if windows and rank == 0:  # the sums are over ranks: rank 0 holds them all
                self.metrics.load_state_dict(self.metrics.merged(windows))
        if rank == 0:
            start = f"resuming from {tag}" if not branch else f"branching from {folder / tag}"
            print(f"pretrieve: {start} (data position: {self.position.describe_position()})", file=sys.stderr,
                  flush=True)
        return counters


def rename_old_parameters(module: torch.nn.Module, tag_dir: Path) -> None:
    """A universal checkpoint keeps each parameter's weights and optimizer state in `zero/<parameter name>/`, where
    DeepSpeed looks for today's names. One written before a module renamed its parameters (the base model was
    `encoder.bert.*` before the backbone interface) has its folders renamed, once, as that module's load hook
    renames state-dict keys (a module's `rename_old_keys(state_dict, prefix)`); the state dict beside them is
    renamed by the hook itself when it loads."""
    zero = tag_dir / "zero"
    names = {p.name: p.name for p in zero.iterdir() if p.is_dir()}
    for prefix, sub in module.named_modules():
        if callable(getattr(sub, "rename_old_keys", None)):
            sub.rename_old_keys(names, f"{prefix}." if prefix else "")
    moves = {old: new for new, old in names.items() if new != old}
    if not moves:
        return
    try:
        for old, new in moves.items():
            (zero / old).rename(zero / new)  # each move whole: a kill midway leaves the rest for the next start
    except OSError as e:
        raise OSError(f"{tag_dir}: its parameters have the names of an older pretrieve ({next(iter(moves))}); "
                      f"renaming them failed ({e}): make the folder writable and resume again") from e
    print(f"pretrieve: {tag_dir.name}: renamed {len(moves)} parameter folders of an older layout "
          f"({next(iter(moves))} -> {moves[next(iter(moves))]}, ...)", file=sys.stderr, flush=True)


def prune_tags(ckpt_dir: Path, latest: str, keep: int, every: int) -> None:
    """Keep `latest` and the `keep` - 1 regular tags (steps that are multiples of `every`) before it; tags after
    it (a save that did not finish) stay until their step is saved again. An older tag off that schedule, the save
    of a stop, goes: `latest` supersedes it, and it must not push out a regular tag a study or a follower reads."""
    older = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step") and p.name < latest)
    stops = [p for p in older if (step := step_of(p.name)) is not None and step % every]
    regular = [p for p in older if p not in stops]
    for old in stops + regular[:max(0, len(regular) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _save_failed(ckpt_dir: Path, tag: str, error: Exception) -> OSError:
    """The save's error in words: torch reports a full disk as "unexpected pos" from its zip writer. The half
    tag is removed (it frees the space it took; `latest` still names the previous one: resume=auto works)."""
    shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
    latest = latest_checkpoint(ckpt_dir.parent)
    full = getattr(error, "errno", None) == errno.ENOSPC or "unexpected pos" in str(error) or \
        "No space left" in str(error) or shutil.disk_usage(ckpt_dir).free < 16 * 2**20
    # a save is a collective (ZeRO partitions, the barrier before `latest` moves): a rank that died breaks it
    peer = not full and (isinstance(error, (ConnectionError, torch.distributed.DistError))
                         or "by peer" in str(error) or "Connection closed" in str(error))
    why = ("no space left on device: " if full else "another rank failed or died during the save: " if peer
           else "") + f"{type(error).__name__}: {str(error)[:300]}"
    fix = "free space" if full else "see the other ranks' logs" if peer else "fix the cause"
    return OSError(errno.ENOSPC if full else errno.EIO,
                   f"{ckpt_dir / tag}: saving the checkpoint failed: {why}. `latest` still names "
                   f"{latest or 'nothing'}: {fix} and rerun with resume=auto")


def load_checkpoint_weights(module: torch.nn.Module, ckpt_dir: Path, tag: str) -> None:
    """Load the weights of checkpoint `tag` into `module` (the trained module, rebuilt): ZeRO 1-3 partitions
    consolidated in fp32, a ZeRO-0 checkpoint read directly."""
    tag_dir = ckpt_dir / tag
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"{tag_dir}: checkpoint tag missing")
    module_file = tag_dir / "mp_rank_00_model_states.pt"  # ZeRO 0-2 (ZeRO 3 writes one per rank, partitioned)
    states = torch.load(module_file, map_location="cpu", weights_only=False)["module"] if module_file.is_file() else {}
    state = states
    if any(tag_dir.glob("*optim_states.pt")):  # ZeRO 1-3: consolidate the fp32 partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        # ZeRO 1 leaves frozen weights (the pooler) out of the consolidated dict; the module states hold them
        expected = module.state_dict()
        for key, value in states.items():
            if key not in state and key in expected and value.shape == expected[key].shape:
                state[key] = value
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids") and not k.endswith("token_type_ids")]
    if missing or unexpected:
        raise ValueError(f"{tag_dir}: checkpoint does not match the run's model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
