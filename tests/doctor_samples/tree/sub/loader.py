import torch

sd = torch.load("a.pt")  # disttrain: ignore[load-without-weights-only]
