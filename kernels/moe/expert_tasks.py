"""How a MoE layer's routed experts split into the tasks of one parallel region, for every weight format's
*_experts matmul (kernels/linear/int8.py, linear_kquant.py, linear_q6k.py).

The experts' packed matrices are stacked, N = out.shape[1] rows each (N % 4 == 0: an expert's rows are whole
blocks of 4); experts: [S] int64 the experts that run; their input rows are grouped by expert, experts[s]'s
rows starts[s]:starts[s + 1] ([S + 1] int64). A task owns EXPERT_TASK_BLOCKS consecutive blocks of 4 output
rows of one expert, for all its tokens: the threads wake once for the layer, not once per expert.
"""

from numba import njit

# blocks of 4 rows a task (one ran slower at 1 token, 32 no faster: benchmarks/results/HISTORY.md)
EXPERT_TASK_BLOCKS = 8


@njit(inline="always", nogil=True)
def expert_num_tasks(num_experts, n, rows):
    # -> the number of tasks over num_experts experts of n rows in blocks of `rows`
    blocks = n // rows
    return num_experts * ((blocks + EXPERT_TASK_BLOCKS - 1) // EXPERT_TASK_BLOCKS)


@njit(inline="always", nogil=True)
def expert_task(task, experts, starts, n, rows):
    # -> (e, r0, r1, b0, b1): task's expert, its input rows r0:r1, its blocks of `rows` output rows b0:b1
    blocks = n // rows
    chunks = (blocks + EXPERT_TASK_BLOCKS - 1) // EXPERT_TASK_BLOCKS
    s = task // chunks
    b0 = (task - s * chunks) * EXPERT_TASK_BLOCKS
    return experts[s], starts[s], starts[s + 1], b0, min(blocks, b0 + EXPERT_TASK_BLOCKS)
