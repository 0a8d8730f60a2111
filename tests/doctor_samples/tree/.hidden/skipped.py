import torch

torch.load("x")
