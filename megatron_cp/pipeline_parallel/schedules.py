"""Forward-backward schedules behind one ``get_forward_backward_func``.

Every schedule has the same contract::

    losses = forward_backward(forward_step_func, loss_func, microbatches, model_chunks,
                              state, forward_only=False)

``forward_step_func(model, batch)`` returns the model output (per-token losses on the last
stage); ``loss_func(output, batch)`` returns ``(loss_for_backward, loss_sum)`` where the
first already carries the token normalization and loss scale. ``losses`` is the list of
detached per-microbatch ``loss_sum`` (empty where this rank holds no last stage).
Gradient reduction is the caller's (``finalize_model_grads``) after the schedule; the DP
bucket reduce is suppressed for all microbatches but the last.
"""
import contextlib


def _no_sync(model):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def forward_backward_no_pipelining(forward_step_func, loss_func, microbatches, model_chunks,
                                   state, forward_only=False):
    """Gradient accumulation over microbatches on a single pipeline stage."""
    if len(model_chunks) != 1:
        raise ValueError(f"without pipeline parallelism there is one model chunk, got {len(model_chunks)}")
    model = model_chunks[0]
    losses = []
    for i, batch in enumerate(microbatches):
        last = i == len(microbatches) - 1
        with contextlib.nullcontext() if (last or forward_only) else _no_sync(model):
            output = forward_step_func(model, batch)
            loss, loss_sum = loss_func(output, batch)
            if not forward_only:
                loss.backward()
        losses.append(loss_sum.detach())
    return losses


def get_forward_backward_func(state):
    """The schedule for this layout: no pipelining at pp=1 (1F1B / interleaved with PP)."""
    if state.size("pp") == 1:
        return forward_backward_no_pipelining
    raise ValueError(f"pipeline_model_parallel_size ({state.size('pp')}) > 1 needs the pipeline "
                     f"schedules, which are not built yet; use 1")
