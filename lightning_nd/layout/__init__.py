"""Pure planning: dims, mesh roles, options, model structure, TP plans, the stage split and `plan_layout`.

No process group and no Lightning here: everything runs on a meta-device model before launch.
"""
