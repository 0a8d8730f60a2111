"""A dt.Job script that keeps its own division by the accumulation count (issue 39).

`job.backward(loss)` divides by the Job's accum_steps; a script carried over from a
hand-written loop often still has `loss = loss / grad_accum` inside `job.steps()`, which
makes the gradients and the logged loss accum_steps times too small with no message.
`loss-divided-twice` reports it. Each test that expects a finding failed before issue 39;
the look-alikes (no accumulation, the plain loss) passed there too.
"""

from __future__ import annotations

import textwrap

from disttrain.doctor.analyzer import analyze_source

SCRIPT = """
import torch
import disttrain as dt

GRAD_ACCUM = 4

def run(data, net):
    with dt.Job(out_dir="runs/accum", accum_steps=GRAD_ACCUM_VALUE) as job:
        model = job.wrap(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = job.loader(data, batch_size=8)
        job.resume(model=model, optimizer=opt)
        for batch in job.steps(loader, max_steps=100):
            loss = model(batch).mean()
            loss = loss / GRAD_ACCUM
            job.backward(loss)
            job.log(loss=loss)
"""


def found(source: str) -> list[tuple[int, str, str]]:
    got = analyze_source("train.py", textwrap.dedent(source))
    return [(f.line, f.severity, f.message) for f in got if f.rule == "loss-divided-twice"]


def division_line(source: str) -> int:
    return next(i for i, x in enumerate(textwrap.dedent(source).splitlines(), 1) if "loss / GRAD_ACCUM" in x
                or "loss /= GRAD_ACCUM" in x)


def test_a_division_inside_the_steps_of_an_accumulating_job_is_an_error():
    src = SCRIPT.replace("GRAD_ACCUM_VALUE", "4")
    [(line, severity, message)] = found(src)
    assert (line, severity) == (division_line(src), "error")
    assert "job.backward()" in message and "accum_steps (4)" in message


def test_dividing_by_the_jobs_own_window_is_an_error_whatever_its_value():
    src = SCRIPT.replace("GRAD_ACCUM_VALUE", "GRAD_ACCUM")
    assert [(line, sev) for line, sev, _ in found(src)] == [(division_line(src), "error")]


def test_an_in_place_division_counts_too():
    src = SCRIPT.replace("GRAD_ACCUM_VALUE", "4").replace("loss = loss / GRAD_ACCUM", "loss /= GRAD_ACCUM")
    assert [(line, sev) for line, sev, _ in found(src)] == [(division_line(src), "error")]


def test_a_window_the_doctor_cannot_see_is_a_warning_that_says_so():
    src = SCRIPT.replace("GRAD_ACCUM_VALUE", "cfg.accum_steps").replace("def run(data, net):",
                                                                          "def run(data, net, cfg):")
    [(line, severity, message)] = found(src)
    assert (line, severity) == (division_line(src), "warning")
    assert "cannot see the value of `cfg.accum_steps`" in message


def test_a_job_that_does_not_accumulate_is_not_reported():
    assert found(SCRIPT.replace("GRAD_ACCUM_VALUE", "1")) == []
    assert found(SCRIPT.replace(", accum_steps=GRAD_ACCUM_VALUE", "")) == []


def test_the_plain_loss_given_to_an_accumulating_job_is_not_reported():
    src = SCRIPT.replace("GRAD_ACCUM_VALUE", "4").replace("            loss = loss / GRAD_ACCUM\n", "")
    assert found(src) == []
