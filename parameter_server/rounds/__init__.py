"""The round logic of the parameter server: who may send, when a round closes, and the outer step.

No HTTP here: :class:`RoundCoordinator` is driven by the server (``submit``, ``wait_result``) and by its own
timer, and hands each closed round to a ``persist`` hook (checkpoint, model file) *before* publishing it, so
a result trainers can see is always on disk. Published rounds are also put on :attr:`RoundCoordinator.published`
for the service (eval loss, round report).

Round rules (docs/training.md, step 7):

* Rounds are numbered from 1; round ``rounds_completed + 1`` is open until ``update_rounds`` rounds are done
  (or :meth:`RoundCoordinator.finish` is called, e.g. on the control plane's ``Done``).
* Each expected peer (``updates.peers``, and any peer the control plane named since) may add one update per
  round. A second one, one for a round that is not the open one, or one that arrives while the round is
  closing raises ``RoundConflict`` (409) and changes nothing: an update is never counted twice.
* The round closes when every peer it waits for sent, or ``round_timeout`` seconds after the *first accepted*
  update. The first accepted update is announced to the ``on_first_update`` hook (the service asks the
  control plane whom to wait for, and asks again while the round waits); :meth:`RoundCoordinator.expect`
  then sets the peers the round waits for (a trainer that died is dropped, a replacement added; later rounds
  start with the same) and may shorten its timeout to when they are projected to send. ``left_out`` names
  the peers the round waited for when it opened, or was told of, that it closed without. A round nobody
  sent to stays open indefinitely: trainers may need long for their inner steps.
* ``g`` is the mean of the accepted updates, weighted by their ``X-Samples`` when ``weighted`` (a missing
  count weighs 1; unweighted means every update weighs 1). Nesterov: ``(u, m) = nesterov_step(g, m)``,
  ``θ_r = θ_{r-1} + u``. If no update with a positive weight was accepted, no step is taken: ``u = 0``, the
  momentum is unchanged, and the result says ``stepped=False``.
* Floating-point *buffers* (``buffers``: BatchNorm's running statistics, named by the model) are averaged,
  not stepped: their ``u`` is ``g``, so ``θ_r`` holds the participants' (weighted) mean of their local
  values, and the momentum has no entry for them. They count in an update's norm like the parameters: a
  trainer cannot move them further than the bound lets it move anything.
* Bounds on an update (refused with ``UpdateRefused``, 422 ``refused_update``, the round unchanged): its L2
  norm (float64) must be finite and at most ``update_norm_ratio`` × the larger of the medians of the norms
  of the round's accepted updates and of the last stepped round's (:func:`~parameter_server.math.norm_limit`;
  the job's first update, or the first after a restart, is measured against the global weights' norm), and
  its sample-weighted values must not overflow the round's sum. X-Samples is bounded by the server.
* A step that is not finite (the mean, ``u``, the new weights or the momentum hold Inf or NaN: a float16
  model past its range, an absurd learning rate) is *discarded*: ``u = 0``, the weights and the momentum stay
  as they were, and the result says ``stepped=False`` and ``discarded=<reason>``. A round never ends the job.
* **Robust aggregation and verification** (``rounds.aggregation``, ``rounds.verification``;
  :mod:`parameter_server.aggregation`, :mod:`parameter_server.rounds.robust`): every rule but an unverified
  ``mean`` *holds* the round's accepted updates as they came (a spooled view keeps its file open, the bounds
  above still apply at arrival) and, when the round closes, scores each (norm ÷ the median norm, cosine to
  the mean of the others), gives it a verdict (``accepted``, ``down-weighted``, ``rejected``: in
  ``RoundResult.verdicts``) and takes ``g`` as the rule's aggregate of those not rejected; a rejected
  update's peer is not a participant and its samples do not count. The step is the same.
* Only floating-point tensors are averaged and stepped, and ``u`` holds only them: other tensors (integer
  buffers such as step counters) keep their global value, and trainers neither send nor receive them.
* **Encodings** (:mod:`hypha_tensors.encoding`; docs/training.md, "Encodings"): an update may come as a
  :class:`~hypha_tensors.encoding.DecodedView` (decoded at every read): its norm and peaks are measured in one
  pass and it is added in a second, so only one decoded tensor is in memory at a time. The result is sent in
  the job's encoding too, with error feedback: the round sends ``Q(u + e)``, keeps
  ``e' = u + e − deQ(Q(u + e))`` and applies what trainers decode, ``θ_r = θ_{r−1} + deQ(Q(u + e))``, so a
  trainer that merges the result holds θ_r bit for bit. ``RoundResult.update`` is that applied (decoded)
  update, ``RoundResult.encoded`` the tensors of the result file. The residual ``e`` lives in memory only: a
  server resumed from a checkpoint starts again from ``e = 0`` (at most half a quantum per value is lost,
  once: the error of one round without feedback).
* The results of the last :data:`KEEP_RESULTS` rounds are kept (their records: the file, no tensors); an
  older one raises ``RoundPruned`` (410).
* **Streaming** (``rounds.overlap = "streaming"``, F fragments; docs/training.md, "Overlap: streaming"):
  round r syncs fragment ``f = (r − 1) mod F`` alone (:mod:`hypha_tensors.fragments`). An update must carry
  exactly f's floating-point tensors (aliases of tied ones renamed as always): another fragment's, or the
  whole model, is refused like any update with wrong names, saying which fragment the round syncs. ``g`` is
  the mean over f's tensors, the step moves f's tensors and f's momentum entries only (every other weight
  and momentum entry is carried into θ_r unchanged, the same tensors), and ``u`` (the result file) holds f's
  tensors only, so at most 1/F of the model is in flight; the digest published with it is of the whole θ_r.
  Norm bounds are per fragment: an update is measured over f's tensors against the norms of f's last
  stepped round (or f's weights' norm). The error-feedback residual of the other fragments waits for their
  rounds. The job's last round (``update_rounds``) syncs every fragment (fragment number F): its updates
  carry every floating-point tensor, each stepped with its own momentum (``m ← g`` for one that had no round
  yet), so the final model holds every trainer's last steps of every tensor. Without fragments, F = 1: every
  round is fragment 0, every tensor.

Modules: :mod:`~parameter_server.rounds.coordinator` (the rules above), :mod:`~parameter_server.rounds.step`
(the outer step's arithmetic), :mod:`~parameter_server.rounds.records` (round results and state),
:mod:`~parameter_server.rounds.robust` (scores, verdicts and robust aggregates).
"""

from __future__ import annotations

from parameter_server.rounds.coordinator import (
    DEFAULT_UPDATE_NORM_RATIO,
    KEEP_RESULTS,
    SPARE_SETS,
    RoundCoordinator,
)
from parameter_server.rounds.records import FirstUpdateHook, PersistHook, RoundResult

__all__ = [
    "DEFAULT_UPDATE_NORM_RATIO",
    "KEEP_RESULTS",
    "SPARE_SETS",
    "FirstUpdateHook",
    "PersistHook",
    "RoundCoordinator",
    "RoundResult",
]
