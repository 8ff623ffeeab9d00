"""Python binding of weight_manager (ctypes over libweight_manager.so).

    from weight_manager import Manager
    with Manager(model_dir="/models/step-100") as m:
        w = np.zeros((4096, 4096), np.float16)
        m.register("w", w)
        stats = m.update()           # snapshot from model_dir, version from version.yaml
        m.clear()

PyTorch (never imported unless you pass torch objects):
    publisher.add_state_dict(model.state_dict())     # trainer
    manager.register_module(model)                    # engine: updates in place
"""

from .manager import (Controller, DeltaStats, DeviceArray, Manager, Placement, Progress, RegisteredModule, Status,
                      UpdateStats, WeightManagerError, version)
from .publisher import Publisher, ServeStats
from .types import DeltaFallback, DType, Piece, QuantScheme, Result, Source, State

__all__ = ["Controller", "DeltaFallback", "DeltaStats", "DeviceArray", "Manager", "Placement", "Publisher", "QuantScheme", "ServeStats", "Progress", "RegisteredModule", "Status", "UpdateStats", "WeightManagerError", "version",
           "DType", "Piece", "Result", "Source", "State"]
