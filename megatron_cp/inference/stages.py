"""One inference forward through the pipeline stages, one stage after the other.

Generation runs one step at a time, so there is nothing to overlap: the (virtual) stages run
in model order, ``chunk 0`` of PP ranks ``0, 1, ..., PP-1``, then ``chunk 1`` of every rank,
and so on (the ring of :mod:`megatron_cp.pipeline_parallel.p2p_communication`), each stage
sending its hidden states ``[s, b, h]`` to the next with a blocking P2P exchange. Every rank
of a stage knows the shape, as every rank knows the tokens.
"""
from megatron_cp.pipeline_parallel import P2PCommunicator


def forward_through_stages(model, run_chunk, tensor_shape):
    """Run ``run_chunk(chunk_index, input_tensor)`` for each chunk of this rank in model order,
    passing activations of ``tensor_shape`` between stages. ``input_tensor`` is None for the
    first stage. Returns the last chunk's output on the last stage, None elsewhere."""
    st, chunks = model.state, model.model_chunks
    pp, rank = st.size("pp"), st.rank("pp")
    if pp == 1:
        output = None
        for c in range(len(chunks)):
            output = run_chunk(c, output)
        return output
    comm = P2PCommunicator.from_state(st, tensor_shape, model.config.params_dtype)
    received, output = None, None
    for c in range(len(chunks)):
        for stage in range(pp):
            last = c == len(chunks) - 1 and stage == pp - 1
            if rank == stage:
                output = run_chunk(c, received)
                if not last:
                    comm.communicate(send_next=output)
            elif rank == (stage + 1) % pp and not last:
                received = comm.communicate(recv_prev=True)[0]  # [s, b, h]
    return output if rank == pp - 1 else None
