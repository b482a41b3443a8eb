"""What a run will be, decided once before any lane exists: the settings (``spec``), the
machine, the plan and its cost model, the processes x lanes topology."""
