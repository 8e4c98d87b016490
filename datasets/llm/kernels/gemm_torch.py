"""C = A @ B.T with PyTorch: cuBLAS in the input dtype (fp32 accumulation) on GPU; fp32 on CPU."""

import torch


@torch.no_grad()
def gemm(A, B):
    if A.is_cuda:
        return torch.matmul(A, B.T)
    return (A.float() @ B.float().T).to(A.dtype)


@torch.no_grad()
def gemm_fp8_block_scale(A, A_scale, B, B_scale):
    """Dequantise per 128-block (A per token and k-block, B per 128x128 block) and multiply in fp32."""
    M, K = A.shape
    N = B.shape[0]
    a = (A.float().view(M, K // 128, 128) * A_scale.T.unsqueeze(-1)).view(M, K)
    b = (B.float().view(N // 128, 128, K // 128, 128) * B_scale[:, None, :, None]).view(N, K)
    return (a @ b.T).to(torch.bfloat16)
