"""Built-in reference models (random weights): the demo, the benchmarks and the tests use them.

torchvision is not a dependency, so ResNet-18 is written out here (same layers and parameter
count, 11.7 M); the encoder is a BERT-like stack; the MLP is 4 x Linear + GELU. Names match
shared/BASELINES.md.
"""

from __future__ import annotations

import torch
from torch import nn

from partitioner.annotate import partition


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers = []
        for cin, cout, stride in ((w, w, 1), (w, 2 * w, 2), (2 * w, 4 * w, 2), (4 * w, 8 * w, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(8 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ff1 = nn.Linear(hidden, 4 * hidden)
        self.ff2 = nn.Linear(4 * hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = nn.functional.scaled_dot_product_attention(q, k, v)
        x = self.norm1(x + self.proj(att.transpose(1, 2).reshape(b, s, h)))
        return self.norm2(x + self.ff2(nn.functional.gelu(self.ff1(x))))


class Encoder(nn.Module):
    """BERT-like: 4 layers, hidden 768, 12 heads by default."""

    def __init__(self, layers: int = 4, hidden: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(EncoderLayer(hidden, heads) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class MLP(nn.Module):
    def __init__(self, width: int = 4096, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(m for _ in range(depth)
                                      for m in (nn.Linear(width, width), nn.GELU())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DemoNet(nn.Module):
    """The demo model: a ResNet-style backbone pinned to the NPU, its head to the CPU (two
    parts in two workers, a tensor crossing between them), precisions left to the model's
    policy."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        backbone = ResNet18(num_classes=num_classes, width=width)
        self.backbone = partition(device="npu")(  # its precision: the model's policy
            nn.Sequential(backbone.stem, backbone.layers))
        self.head = partition(device="cpu")(
            nn.Sequential(nn.Linear(8 * width, 256), nn.GELU(), nn.Linear(256, num_classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.backbone(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def reference(name: str, batch: int = 1) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A reference model in eval mode and example inputs: resnet18, bert4, mlp, demo."""
    torch.manual_seed(0)
    if name == "resnet18":
        return ResNet18().eval(), (torch.randn(batch, 3, 224, 224),)
    if name == "bert4":
        return Encoder().eval(), (torch.randn(batch, 128, 768),)
    if name == "mlp":
        return MLP().eval(), (torch.randn(batch, 4096),)
    if name == "demo":
        return DemoNet().eval(), (torch.randn(batch, 3, 64, 64),)
    raise ValueError(f"unknown reference model {name!r}; expected resnet18, bert4, mlp or demo")
