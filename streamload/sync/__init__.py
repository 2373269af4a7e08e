"""Weight sync: the trainer's weights into a rollout engine, in hub layout, a layer group at a
time (``source.py``), with the vLLM glue (``vllm_engine.py``) and the driver (``driver.py``)."""
