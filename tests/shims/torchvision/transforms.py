class Compose:
    """Named in one of Heat's annotations; never called by the tests."""

    def __init__(self, transforms):
        self.transforms = transforms


class _Namespace:
    __all__: list = []


transforms = _Namespace()  # heat.utils.vision_transforms looks names up in transforms.transforms.__all__
