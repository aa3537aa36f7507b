"""A module's ``group`` attribute (a torch.distributed process group) held weakly."""
import weakref


class WeakGroup:
    """A ``group`` attribute (a torch.distributed process group, or None) held by a weak
    reference.  An object that outlives ``destroy_process_group()`` (a model kept to the
    end of a script) would otherwise keep the group to the end of the process, and gloo's
    group destroyed that late aborted the process at exit ("terminate called without an
    active exception", 4 runs in 10); torch's own registry keeps a live group alive."""

    def __set_name__(self, owner, name):
        self.key = f"_{name}_ref"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        ref = obj.__dict__.get(self.key)
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError("group: the torch.distributed process group this was built "
                               "with was destroyed (destroy_process_group); build it again "
                               "with a live group")
        return group

    def __set__(self, obj, value):
        try:
            obj.__dict__[self.key] = None if value is None else weakref.ref(value)
        except TypeError:
            raise TypeError(f"group: expected a torch.distributed process group or None, "
                            f"got {type(value).__name__}") from None
