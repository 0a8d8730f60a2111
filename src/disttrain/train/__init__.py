"""The training loop of disttrain (`dt.Job`) and `disttrain train`'s adapter over it.

job.py               dt.Job and its step loop (wrap, loader, evaluator, resume, steps)
metrics_window.py    job.log's window and its records (metrics.jsonl, run log, bar)
non_finite_stop.py   no non-finite loss or weights are saved: one agreed stop
job_config.py        what configures a Job: Config, RunOptions, short keywords
start_point.py       where a Job starts: memory (fast recovery), a checkpoint, or step 0
save_cadence.py      checkpoint cadence (steps, seconds agreed by the ranks) and on_error
evaluation.py        the eval set sharded across ranks, (sum, count) metrics, its period
step_ownership.py    Job steps what it was given: a script's own step/backward is an error
sample_queue.py      which samples each batch holds (the sample audit)
optimizer_order.py   which optimizers were built before wrap (refused by resume)
run_summary.py       summary.json and the table, over every attempt of a run
run_log.py           per-rank step time (StepClock) and memory, run_events.jsonl, TensorBoard
trackers.py          W&B and MLflow: rank 0's records, one tracker run across attempts
tracker_checks.py    a tracker that cannot start (no key, no server): one line, before training
accumulation.py      Accumulator (no_sync, loss scaled once, clip, step), warmup_cosine
global_metrics.py    global (sum, count) means: global_sum, global_mean, MeanTracker
rank0_output.py      rank 0's JSONL writer and print_main
progress.py          rich progress bar and summary table
resume_plan.py       the "checkpoint -> now" config comparison on resume
launcher_findings.py what the launcher of `disttrain train` found, handed to the ranks
model_data_loss.py   the model, data and loss a config names (built-in or the user's)
batches.py           a batch moved to the device, through the model, to its loss
hf_models.py         Hugging Face models for [model] hf / hf_path
trainer.py           `disttrain train`'s per-rank job: the TOML driving a Job
script_runner.py     a Job script under `disttrain run --fast-recovery`
__main__.py          `python -m disttrain.train CONFIG.toml [overrides]`: what torchrun runs
"""
