"""Published failure mixes, by name: `fleet.preset` (scenario/fleet.py) fills `fleet.components` from one.

Each mix gives every component's mean time between failures of one unit
(`mtbf`) and, where a source says how a failure is noticed, its `detection`;
a component the scenario gives keeps the mix's value of each field it does
not give.

- **llama3-405b** (the default): the Llama 3 405B pre-training run (Llama
  Team, "The Llama 3 Herd of Models", 2024, section 3.3.4, Table 5): 466
  interruptions in a 54-day snapshot on 16,384 H100s (2,048 hosts of 8), 47
  planned and 419 unexpected. Each row becomes `54 d x units / interruptions`:
  gpu: faulty GPU 148, GPU SRAM 19, GPU system processor 17, thermal interface
  and sensor 6 (190, per GPU); sdc: silent data corruption 6 (per GPU); hbm:
  HBM3 72 (per GPU); nic: 7 (per GPU, one NIC each); host: host maintenance
  32, SSD 3, power supply 3, chassis 2, IO expansion board 2, CPU 2, system
  memory 2 (46, per host); cable: network switch/cable 35 (per GPU-to-leaf
  cable); software: software bug 54, NCCL watchdog timeout 7, dependency 2
  (63, per host); maintenance: the 47 planned interruptions (per job).
  Detection: software waits torch's NCCL watchdog (600 s); a silent data
  corruption is noticed late (3600 s, an assumption: no source gives the
  delay); a planned stop is not detected (0 s); the rest take
  `fleet.recovery.detection`.
- **meta-rsc1**, **meta-rsc2**: Meta's two A100 research clusters (Kokolis
  et al., "Revisiting Reliability in Large-Scale Machine Learning Research
  Clusters", HPCA 2025, arXiv 2410.21680, section IV): 6.50 and 2.34
  infrastructure failures per 1,000 node-days (hosts of 8 A100s), every cause
  together, so one host component of mean `1000 d / 6.50` (153.8 days) and
  `1000 d / 2.34` (427.4 days); nothing else fails.

    PRESETS["meta-rsc1"]["components"]["host"]   # {"mtbf": 13292307.69...}
"""
DAY_S = 86400.0
LLAMA3_S = 54 * DAY_S  # Table 5's window
_LLAMA3_GPUS, _LLAMA3_HOSTS = 16_384, 2_048
WATCHDOG_S = 600.0  # torch.distributed.constants.default_pg_nccl_timeout
SDC_DETECTION_S = 3600.0  # an assumption: no published figure (docs/guides/fleet.md, "Sources")


def _llama3(interruptions: int, units: int, **more) -> dict:
    return {"mtbf": LLAMA3_S * units / interruptions, **more}


_NEVER = {"mtbf": None}
_LLAMA3 = {
    "gpu": _llama3(190, _LLAMA3_GPUS), "hbm": _llama3(72, _LLAMA3_GPUS), "nic": _llama3(7, _LLAMA3_GPUS),
    "nvswitch": _NEVER, "host": _llama3(46, _LLAMA3_HOSTS), "cable": _llama3(35, _LLAMA3_GPUS),
    "leaf": _NEVER, "spine": _NEVER, "storage": _NEVER, "software": _llama3(63, _LLAMA3_HOSTS, detection=WATCHDOG_S),
    "sdc": _llama3(6, _LLAMA3_GPUS, detection=SDC_DETECTION_S), "maintenance": _llama3(47, 1, detection=0.0),
}


def _node_level(failures_per_1000_node_days: float) -> dict:
    """One rate per host for every cause: nothing else fails on its own."""
    return {name: {"mtbf": 1000 * DAY_S / failures_per_1000_node_days} if name == "host" else _NEVER
            for name in _LLAMA3}


PRESETS = {"llama3-405b": {"components": _LLAMA3}, "meta-rsc1": {"components": _node_level(6.50)},
           "meta-rsc2": {"components": _node_level(2.34)}}
PRESET_NAMES = tuple(PRESETS)


def with_preset(raw: dict) -> dict:
    """The fleet section `raw` with its preset's components under the ones it gives (each field it gives wins)."""
    preset = PRESETS.get(raw.get("preset", "llama3-405b")) if isinstance(raw.get("preset", ""), str) else None
    given = raw.get("components", {})
    if preset is None or not isinstance(given, dict):
        return raw  # the field's own validation names what is wrong
    components = {name: {**fields, **given[name]} if isinstance(given.get(name), dict) else given.get(name, fields)
                  for name, fields in preset["components"].items()}
    components.update({name: value for name, value in given.items() if name not in components})  # refused later
    return {**raw, "components": components}
