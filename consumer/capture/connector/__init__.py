"""The folder put on vLLM's PYTHONPATH so that its `kv_connector_module_path` can name the one
module here: nothing in it may import genqueue (vLLM's interpreter does not have it)."""
