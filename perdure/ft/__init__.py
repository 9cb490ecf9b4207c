"""TorchFT replica groups: a job made of several groups (each one process or a torchrun of DDP ranks) coordinated by a
lighthouse, where a group that dies does not stop the others and a restarted group heals from a live peer.

See docs/fault-tolerance.md. torchft itself is optional (`pip install 'perdure[ft]'`) and imported only when a group
starts training.
"""
