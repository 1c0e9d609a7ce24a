"""The autotuner's plain parts: the search space, the search, the trial guard and the report
(see [Note: how the autotuner searches] and [Note: a trial that fails on one rank]). The trials
themselves run in ``lightning_zero.callbacks.autotuner``."""

from lightning_zero.autotuning.guard import GuardedCollectives, PeerFailed, TrialGuard, is_out_of_memory
from lightning_zero.autotuning.search import SearchResult, TrialRecord, TrialStatus, TuningError, search
from lightning_zero.autotuning.space import Candidate, SearchSpace, parse_bytes

__all__ = ["Candidate", "GuardedCollectives", "PeerFailed", "SearchResult", "SearchSpace", "TrialGuard", "TrialRecord",
           "TrialStatus", "TuningError", "is_out_of_memory", "parse_bytes", "search"]
