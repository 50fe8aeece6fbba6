"""report.json's `weight_norms`: the trained model's per-layer weight norms over training.

BatchNorm makes the loss blind to the scale of the weights before it, so
nothing but weight decay holds their norms (scenarios/bn_weight_decay.yaml).
The Frobenius norm of every Linear and Conv2d weight (train/models.py
weight_norms), by its module's name in the whole model, is taken before
training (step 0), after every `report.every`-th step and after the last,
from the model as data-parallel replica 0 holds it (the scheme's
`trained_model`, assembled from its ranks' shares, as the training-set loss
is evaluated). Without values (numerics off) or where this process holds
only some ranks (a real run) no norm is taken, and the report has no
section. `before_batchnorm` names the layers whose output a BatchNorm
normalizes.

    norms = WeightNormLog(scheme.trained_model, job.model, every=50, steps=400, taking=True)
    norms.step_done(step)           # once every rank has ended step `step` (0-based)
    norms.section()                 # {"weight_norms": {...}}
"""
from pydantic import Field

from ..report.sections import ReportSection, register_section
from ..train.models import layers_before_batchnorm, weight_norms


class WeightNormLog:
    """Per-layer weight norms of the trained model, before training and every `every` steps."""

    def __init__(self, trained_model, template, every: int, steps: int, taking: bool):
        self.trained_model = trained_model  # () -> the whole model as data-parallel replica 0 holds it now
        self.before_batchnorm = layers_before_batchnorm(template)
        self.every, self.steps, self.taking = every, steps, taking
        self.taken_after = [0]  # the steps after which the norms were taken (0: before training)
        self.layers = ({name: [norm] for name, norm in weight_norms(trained_model()).items()} if taking else {})

    def step_done(self, step: int) -> None:
        """Step `step` (0-based) has ended on every rank: the norms taken after every `every`-th step and the
        last."""
        done = step + 1
        if self.taking and (done % self.every == 0 or done == self.steps):
            self.taken_after.append(done)
            for name, norm in weight_norms(self.trained_model()).items():
                self.layers[name].append(norm)

    def rewind(self, step: int) -> None:
        """Forget the norms taken after step `step`: the job restarts there (recovery.py)."""
        kept = sum(1 for done in self.taken_after if done <= step)
        del self.taken_after[kept:]
        for norms in self.layers.values():
            del norms[kept:]

    def section(self) -> dict:
        """report.json's `weight_norms` (WeightNormsSection), where norms were taken."""
        if not self.taking:
            return {}
        return {"weight_norms": {"steps": list(self.taken_after),
                                 "layers": {name: list(norms) for name, norms in self.layers.items()},
                                 "before_batchnorm": self.before_batchnorm}}


class WeightNormsSection(ReportSection):
    steps: list[int] = Field(description="the steps after which the norms were taken")
    layers: dict[str, list[float | None] | dict[str, list[float | None]]] = Field(
        description="each layer's weight norm at those steps (a layer with several weights: by weight name); "
                    "null: not finite")
    before_batchnorm: list[str] = Field(description="the layers whose output a BatchNorm normalizes")


register_section("weight_norms", WeightNormsSection, "weight norms of every layer over training "
                                                     "(strategies/weight_norms.py)")
