"""Notebook widgets and plotly figures for rlbench (imported only by notebooks; the library never imports viz).

    from rlbench.viz import StepController, LiveDashboard, RolloutViewer, PackingInspector
    from rlbench.viz import image_rollouts_html, image_rows   # VLM samples: images + rollouts as HTML
"""

from rlbench.viz.controller import StepController
from rlbench.viz.dashboard import PANELS, LiveDashboard
from rlbench.viz.image_rollouts import image_rollouts_html, image_rows
from rlbench.viz.packing_plan import PackingPlan, cp_work, plan_packing
from rlbench.viz.packing_view import PackingInspector, cp_figure, packs_figure
from rlbench.viz.rollout_view import RolloutViewer, group_html

__all__ = [
    "PANELS",
    "LiveDashboard",
    "PackingInspector",
    "PackingPlan",
    "RolloutViewer",
    "StepController",
    "cp_figure",
    "cp_work",
    "group_html",
    "image_rollouts_html",
    "image_rows",
    "packs_figure",
    "plan_packing",
]
