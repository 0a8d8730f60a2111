"""loss-divided-twice, accumulation-without-no-sync, accumulation-off-by-one,
gradscaler-unsynced, fsdp1-clip-grad, fsdp2-no-sync, fsdp2-fp16-without-scaler: the
optimizer step.

Each test is a small script written for this suite: the pitfall the rule must flag, or a
look-alike it must leave alone. A comment may name the public project whose review
showed the case (a fact); the code is ours.
"""

from __future__ import annotations

import textwrap

from rule_check import FSDP_AS_A_MODE, PRE, PRE_FSDP2, found, found_in, rule_severities

# HAND_REDUCED_SCALED_GRADS: the scaled gradients are all-reduced by hand (a helper in utils) before
# scaler.step unscales them: every rank sees the same inf/nan
HAND_REDUCED_SCALED_GRADS = PRE + """
from torch.cuda.amp import GradScaler
def mean_grads(params):
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
def fit(net, opt, batches):
    scaler = GradScaler(1024)
    for x in batches:
        loss = net(x)
        scaler.scale(loss).backward()
        mean_grads(net.parameters())
        scaler.step(opt)
        scaler.update()
fit(None, None, [])
"""


def test_a_grad_scaler_after_assert_not_fsdp_is_the_ddp_path_s():
    assert found(FSDP_AS_A_MODE, "gradscaler-unsynced") == []
    on = FSDP_AS_A_MODE.replace('        assert not args.fsdp, "amp runs on the DDP path only"\n', "")
    assert [f[0] for f in found(on, "gradscaler-unsynced")] == ["gradscaler-unsynced"]


def test_gradients_reduced_by_hand_before_the_scaler_step_need_no_synced_scaler():
    assert found(HAND_REDUCED_SCALED_GRADS, "gradscaler-unsynced") == []
    late = HAND_REDUCED_SCALED_GRADS.replace("        mean_grads(net.parameters())\n        scaler.step(opt)\n",
                        "        scaler.step(opt)\n        mean_grads(net.parameters())\n")
    assert [f[2] for f in found(late, "gradscaler-unsynced")] == ["warning"]
    unscaled = HAND_REDUCED_SCALED_GRADS.replace("        mean_grads(net.parameters())\n",
                            "        scaler.unscale_(opt)\n        mean_grads(net.parameters())\n")
    assert [f[2] for f in found(unscaled, "gradscaler-unsynced")] == ["warning"]


def test_accumulation_without_no_sync_with_the_loop_and_the_wrap_in_different_files(tmp_path):
    engine = """
    def one_pass(net, opt, batches, every):
        for i, x in enumerate(batches):
            loss = net(x).mean() / every
            loss.backward()
            if (i + 1) % every == 0:
                opt.step()
                opt.zero_grad()
    """
    main = PRE + textwrap.dedent("""
    from engine import one_pass
    model = DDP(nn.Linear(2, 2).cuda(), device_ids=[local_rank])
    """)
    got = found_in(tmp_path, {"engine.py": engine, "main.py": main}, "accumulation-without-no-sync")
    assert got == [("engine.py", "accumulation-without-no-sync", 7, "warning")]


def test_a_plain_grad_scaler_is_right_under_fsdp2():  # torch 2.13: DTensor reduces found-inf
    src = (PRE_FSDP2 + "fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))\n"
           "scaler = torch.amp.GradScaler('cuda')\n")
    assert not [r for r in rule_severities(src) if r[0] in ("gradscaler-unsynced", "fsdp2-fp16-without-scaler")]


def test_accelerate_no_sync_under_fsdp2_is_the_library_s_business():
    src = PRE_FSDP2 + "fully_shard(model)\nwith accelerator.no_sync(model):\n    pass\n"
    assert not [r for r in rule_severities(src) if r[0] == "fsdp2-no-sync"]


def test_a_loss_divided_by_the_accumulation_count_twice_is_an_error():
    src = PRE + "accum = 8\nfor x in batches:\n    loss = net(x).mean() / accum\n    loss = loss / accum\n" \
                "    loss.backward()\n"
    assert found(src, "loss-divided-twice") == [("loss-divided-twice", 14, "error")]
    # another divisor (a temperature) before the one division by the count is no second one
    scaled = PRE + "accum, tau = 8, 0.07\nfor x in batches:\n    logits = net(x) / tau\n" \
                   "    loss = logits.mean() / accum\n    loss.backward()\n"
    assert found(scaled, "loss-divided-twice") == []


def test_stepping_when_a_zero_based_index_is_a_multiple_steps_after_one_micro_batch():
    src = PRE + "every = 2\nfor n, x in enumerate(batches):\n    (net(x).mean() / every).backward()\n" \
                "    if n % every == 0:\n        opt.step()\n        opt.zero_grad()\n"
    assert found(src, "accumulation-off-by-one") == [("accumulation-off-by-one", 15, "warning")]
    # counting from 1 makes the same test step after each full window
    from_one = src.replace("enumerate(batches)", "enumerate(batches, start=1)")
    assert found(from_one, "accumulation-off-by-one") == []


def test_the_torch_clip_on_an_fsdp1_module_clips_each_shard_by_its_own_norm():
    clip = "torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.5)\n"
    fsdp1 = PRE + "from torch.distributed.fsdp import FullyShardedDataParallel\n" \
                  "net = FullyShardedDataParallel(nn.Linear(4, 4).cuda())\n" + clip
    assert found(fsdp1, "fsdp1-clip-grad") == [("fsdp1-clip-grad", 13, "error")]
    # the same call on a DDP replica or an FSDP2 (DTensor) module sees the global norm
    ddp = PRE + "net = DDP(nn.Linear(4, 4).cuda(), device_ids=[local_rank])\n" + clip
    fsdp2 = PRE + "from torch.distributed.fsdp import fully_shard\nnet = nn.Linear(4, 4).cuda()\n" \
                  "fully_shard(net)\n" + clip
    assert found(ddp, "fsdp1-clip-grad") == [] and found(fsdp2, "fsdp1-clip-grad") == []


# the shape of a trainer that picks its engine by a string: the set-up wraps with DDP or
# FSDP, the step clips with whichever call the engine needs
ENGINE_BY_NAME = PRE + textwrap.dedent("""
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
def build(args, net):
    if args.engine == "torch_ddp":
        return DDP(net, device_ids=[local_rank])
    else:
        return FSDP(net)
class Runner:
    def step(self, model):
        if self.engine == "torch_ddp":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            model.clip_grad_norm_(1.0)
""")


def test_an_fsdp_rule_stays_off_the_ddp_branch_of_an_engine_choice():
    assert found(ENGINE_BY_NAME, "fsdp1-clip-grad") == []
    # the same clip on every engine's path is FSDP's on the FSDP path: reported
    anyway = ENGINE_BY_NAME.replace('        if self.engine == "torch_ddp":\n            torch.nn', "        torch.nn")
    anyway = anyway.replace("        else:\n            model.clip_grad_norm_(1.0)\n", "")
    assert [(r, s) for r, _, s in found(anyway, "fsdp1-clip-grad")] == [("fsdp1-clip-grad", "error")]


def test_a_base_method_the_fsdp_subclass_overrides_is_judged_in_the_class_that_runs_it():
    src = PRE + textwrap.dedent("""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    class Engine:
        def clip(self):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
    class ShardedEngine(Engine):
        def __init__(self, net):
            self.model = FSDP(net)
        def clip(self):
            self.model.clip_grad_norm_(1.0)
    """)
    assert found(src, "fsdp1-clip-grad") == []
    inherited = src.replace("    def clip(self):\n        self.model.clip_grad_norm_(1.0)\n", "")
    assert [r for r, _, _ in found(inherited, "fsdp1-clip-grad")] == ["fsdp1-clip-grad"]
