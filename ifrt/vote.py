"""A step kept everywhere or nowhere: a vote of every process at the end of each step, decided once by the
coordinator, so every process gets the same answer.

    vote = ifrt.Vote(client, scope)            # scope: unique to this start of the job (e.g. its start-up nonce)
    ...backward...
    if vote():                                 # True in every process, or False in every process
        optimizer.step()

Each round is a coordinator barrier ``<scope>/vote/<round>``: it completes when every process voted, and fails for
every process at once when one of them fails (killed, hung past the heartbeat timeout, or left) or votes no. A
round supersedes the one before it, so the coordinator keeps two rounds of a series however many steps run.

Only a voter can say no: a no cancels the round's barrier, and the coordinator lets only a participant cancel one
(a cancel by another process before anyone voted is kept for that process and dropped when the round starts without
it). A round the coordinator cannot keep (its ``--max-barriers`` or ``--max-barrier-bytes`` is reached, or this
process's share of them, which its own no needs for a moment) is no answer: ``ResourceExhausted`` (or
``InvalidArgument``) names the vote, the round and the bound, in every voter that reached it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ifrt.client import Client
from ifrt.errors import BarrierCancelled, BarrierFailed, BarrierTimeout, InvalidArgument, PermissionDenied

DEFAULT_VOTE_TIMEOUT_S = 600.0
"""How long a round waits for a process that is alive but has not voted (a step that slow is a fault to report)."""


class Vote:
    """Rounds of a vote over ``process_ids`` (default: every process of the topology) under ``scope``."""

    def __init__(self, client: Client, scope: str, process_ids: Sequence[int] | None = None,
                 timeout: float = DEFAULT_VOTE_TIMEOUT_S) -> None:
        if not scope:
            raise InvalidArgument("a vote's scope is empty: expected a name unique to this start of the job (a "
                                  "restarted job must not meet the rounds of the last one)")
        self.client, self.scope, self.process_ids, self.timeout = client, scope.rstrip("/"), process_ids, timeout
        self.round = 0
        """The next round's number: how many rounds this process has voted in."""
        self.failed = False
        """Whether the last round ended because a process failed or left (a recovery is due), not by a no."""
        self.why = ""
        """Why the last round answered False: the coordinator's words, naming the voter that said no or the process
        that failed or left ("" after True)."""

    def __call__(self, ok: bool = True) -> bool:
        """This process's vote on the current step; True only if every process voted yes and none failed, the same
        answer in every process (``why`` says who made it False). BarrierTimeout, in every process, names the
        processes that did not vote within the timeout; ResourceExhausted or InvalidArgument names the vote, its
        round and the coordinator's bound when the round cannot be held (see the module's docstring)."""
        round_ = self.round
        name = self._name(round_)
        supersedes = self._name(round_ - 1) if round_ else ""
        self.round += 1
        self.failed, self.why = False, ""
        try:
            if not ok:
                self.client.cancel_barrier(name, process_ids=self.process_ids)
            self.client.barrier(name, self.timeout, self.process_ids, supersedes=supersedes)
        except BarrierTimeout:
            raise
        except BarrierCancelled as e:  # a voter said no
            self.why = str(e)
            return False
        except BarrierFailed as e:  # a process failed or left before every vote was in
            self.failed, self.why = True, str(e)
            return False
        except (InvalidArgument, PermissionDenied) as e:  # ResourceExhausted too: the coordinator cannot keep the round
            voters = "every process" if self.process_ids is None else f"processes {sorted(self.process_ids)}"
            raise type(e)(f"vote {self.scope!r} round {round_} of {voters} cannot be held, so it has no answer: "
                          f"{e}") from e
        return True

    def _name(self, round_: int) -> str:
        return f"{self.scope}/vote/{round_}"
