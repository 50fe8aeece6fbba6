"""How devices cooperate, composed: layouts, strategies and pipeline schedules (DESIGN.md, issue 51)."""
