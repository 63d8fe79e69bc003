"""The deployment: the serving system's lifecycle plane, beside the router and the workers.

``deployment.placement.Deployment`` turns a placement and a device set into workers (plain
objects in this process, or Ray actors), the router over them and the hub of their
channels; ``deployment.ray_actors`` places, starts, watches and kills the actors (the only
pdlab module that imports Ray at module level; ``kv_transfer.ray_store`` aside, no other
package imports Ray); ``deployment.restarts`` restarts dead workers under a budget.
"""
