"""`disttrain run --check`: the bugs that only show when the program runs, found in the
user's unchanged script by checks installed from outside it (docs/check.md).

    settings.py     the --check / --check-steps flags and the window (no torch)
    session.py      the hooks' installation, the check window, each checked step
    channel.py      the checks' own gloo group: every rank's numbers, bit for bit
    model_watch.py  global module hooks: the models run, DDP wrappers, `.module` bypass
    replicas.py     parameters, gradients and buffers compared across replicas
    data.py         the DataLoader wrapper: same samples, batches per epoch, set_epoch
    wrapping.py     an optimizer holding parameters the model no longer has
    micro_steps.py  accumulation under DDP without no_sync()
    samples.py      per-sample fingerprints: samples two ranks share, data split twice
    zeroing.py      gradients carried into the next step (no zero_grad between)
    dead_gradients.py
                    every gradient exactly zero, step after step
    collective_watch.py
                    torch.distributed's collectives wrapped: each call, optimizer step
                    and end compared across ranks before it can hang
    sequence.py     those events compared through the job's store, with a bounded wait
    fingerprints.py a call in words, and what must match across ranks
    results.py      the results checks' records, exchanged at checked steps and the end
    numbers.py      a number rank 0 printed from its own shard of an evaluation
    saves.py        torch.save: one file from several ranks, a wrapper's `module.` keys
    rng_restore.py  every rank restored one rank's RNG state
    float16.py      float16 without a loss scaler; GradScaler skips that differ by rank
    patches.py      public functions wrapped for the window, and put back
    verdicts.py     the messages, the stop (exit 3) and the summary
"""
