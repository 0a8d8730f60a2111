"""`disttrain doctor` on dt.Job scripts (issue 26): a second scheduler step, an optimizer
built before job.wrap, a leftover backward or optimizer step inside job.steps()."""

from __future__ import annotations

from test_doctor_dataflow import PRE, found  # noqa: F401  (shared helpers)

JOB = """
import torch
import disttrain as dt

with dt.Job(out_dir="runs/x", accum_steps=4) as job:
    model = job.wrap(torch.nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000)
    loader = job.loader(dataset, batch_size=32)
    job.resume(model=model, optimizer=opt, scheduler=sched)
    for batch in job.steps(loader, max_steps=1000):
        loss = model(batch).mean()
        job.backward(loss)
"""


def test_a_correct_job_script_has_no_findings():
    assert found(JOB) == []


def test_a_second_scheduler_step_inside_job_steps():
    src = JOB + "        sched.step()\n"
    assert found(src, "job-scheduler-stepped-twice") == [("job-scheduler-stepped-twice", 14, "error")]


def test_an_optimizer_built_before_job_wrap():
    src = JOB.replace("""    model = job.wrap(torch.nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
""", """    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model = job.wrap(model)
""")
    assert found(src, "job-optimizer-before-wrap") == [("job-optimizer-before-wrap", 7, "error")]


def test_a_leftover_backward_and_optimizer_step_inside_job_steps():
    src = JOB + "        loss.backward()\n        opt.step()\n"
    assert found(src, "job-manual-step") == [("job-manual-step", 14, "error"), ("job-manual-step", 15, "error")]


