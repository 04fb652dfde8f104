"""The memory of braze's GPU plans, checked without a GPU ([Note: plans without a GPU] in
braze-driver, `braze.plan_memory`): real models traced on fake CUDA tensors, planned as on an
H100/H200, and their plans walked the way the call loop allocates and frees."""
import torch

from braze import bench_models as bm
from braze import plan_memory

MiB = 2**20


def test_resnet50_inference_peak_is_one_bottleneck():
    """ResNet-50 channels_last b64 bf16 inference: every op is braze's (cuDNN convolutions
    from its runs), and the plan's peak is what one bottleneck needs at its expanding
    convolution (the block's input, its output and the 3x3 result it reads: Inductor's
    measured peak, 220.6 MiB on the H200), not that plus the spent result of the block's
    first convolution ([Note: spent-bytes cuts]; 245.1 MiB before, measured on the H200 and
    by this model of the plan alike)."""
    build, make_inputs, _ = bm._configs(True)["resnet50"][:3]
    torch.manual_seed(0)
    model = build().eval()
    inputs = make_inputs(torch.device("cpu"))[0]
    graph, lowered = plan_memory.inference_plan(model, inputs)
    assert not lowered.fallbacks, lowered.fallbacks
    assert lowered.library_convs == 53
    peak, trace = plan_memory.simulate(graph)
    wide, narrow = 64 * 256 * 56 * 56 * 2, 64 * 64 * 56 * 56 * 2
    assert peak <= 2 * wide + narrow + MiB, (peak / MiB, sorted(trace, key=lambda r: -r[1])[:3])
    # And no less than that: the model of the plan counts what is live.
    assert peak >= 2 * wide + narrow
