"""Starting processes: `disttrain run` on torchrun (run_command.py, its --help in
run_help.py), `disttrain train`'s
validate-then-launch (train_command.py), and a local etcd for the etcd rendezvous
(etcd_server.py). Light at import: torch is imported only where a command needs it.
"""
