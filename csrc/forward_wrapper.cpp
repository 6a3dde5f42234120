// fastdump._C.ForwardWrapper and fastdump._C.CaptureState: the per-module forward wrapper in C.
//
// Issue 11: on a small model the Python wrapper (is_compiling(), attribute reads, *args/**kwargs
// repacking, the call-count dict, a Python call per tensor and a Python loop for tuple outputs)
// cost the model's thread ~4 us per dumped tensor; its C++ staging was under 1% of that. This type
// is the same wrapper written against the C API:
//  - outside a pass it vectorcalls the original forward and returns (one flag read);
//  - inside a pass it numbers the call when it starts (its `#k`: calls are numbered in the order
//    they start, so a module that calls itself gives its inputs and its output the same number);
//    for an exact torch.Tensor or a tuple/list of exact tensors (None skipped; at least one tensor)
//    returned by the module's first call of the pass, it stages each tensor through the channel's
//    C++ stage_tensor with name ids cached per wrapper;
//  - everything else (a second call `name#k`, other outputs, a name without an id yet, a status
//    other than STAGED, an error) goes to the Dumper's Python methods, which account for it
//    exactly as the Python wrapper does. Nothing fastdump does raises into the model (failures go
//    to Dumper._capture_failed); the model's own exceptions propagate unchanged.
// Given an `owner` (the module, when what it wraps is the module's class forward), the wrapper
// follows that class's forward as attribute lookup would: a library that patches the class after
// attach (`Cls.forward = patched`) is honoured while dumping, as it is without fastdump. The check
// is one compare per call (the type's attribute-cache version tag); a changed tag looks the
// forward up again.
// The wrapper has a __dict__, so functools.update_wrapper gives it __wrapped__, __name__, __doc__...
// and inspect.signature(module.forward) is the original's (transformers' generate() inspects it).
// Dynamo cannot trace C code: a compiled model graph-breaks here and the wrapper runs eagerly on
// real tensors.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bindings.h"
#include "ring.h"

namespace py = pybind11;

namespace fastdump {
namespace {

// Outputs with more elements than this take the Python path (nothing real returns that many).
constexpr Py_ssize_t kMaxFastElements = 64;

PyObject* s_stage;           // Dumper._stage(name, tensor): a name without an id yet
PyObject* s_fast_status;     // Dumper._fast_status(name, tensor, status): anything but STAGED
PyObject* s_capture;         // Dumper._capture(name, output): every other output
PyObject* s_capture_inputs;  // Dumper._capture_inputs(name, args, kwargs)
PyObject* s_capture_failed;  // Dumper._capture_failed(name, value, exc)
PyObject* s_emit_safely;     // Dumper._emit_safely(name, value)
PyObject* s_use_python;      // Dumper._use_python_wrappers(): torch.compile is tracing the model
PyObject* s_check_thread;    // Dumper._check_thread(): a call from another thread joined the open pass
PyObject* s_one;             // 1, the call count of a first call

// One Dumper's state shared by its wrappers. `capturing` is THE flag (Dumper._capturing reads and
// writes it); `calls` and `name_ids` are the Dumper's own dicts (one source of truth).
struct CaptureState {
  PyObject_HEAD
  int capturing;
  int probed;  // this pass's first capturing call asked whether torch.compile is tracing
  uint64_t serial;  // passes begun (capturing turned on): a call that outlives its pass is numbered again
  unsigned long pass_thread;  // the thread that turned capturing on (opened the pass)
  PyObject* dumper;
  PyObject* calls;        // dict: name -> calls this pass (Dumper._calls, cleared per pass)
  PyObject* name_ids;     // dict: name -> id (Dumper._name_ids; ids never change)
  PyObject* tensor_type;  // torch.Tensor (exact type: subclasses take the Python path)
  PyObject* lane;         // the channel's ChannelStager, or None
  void* lane_ptr;         // its C++ object, or nullptr
  // torch.compile: while Dynamo's frame callback is set (probe() is not None), every Python frame
  // started here would be traced; the Dumper's methods are called through outside(method, *args)
  // (torch._disable_dynamo) instead. Both None without torch.
  PyObject* dynamo_probe;
  PyObject* dynamo_outside;
  double liveness_s;  // root_pass: the writer seen alive this recently (engine.LIVENESS_POLL_S)
  // Nesting (an EAGLE draft run inside the target's forward, by a hook or the forward itself): while
  // another Dumper's pass is open inside this one's on its thread, this one's wrappers pass through
  // (`capturing` 0, `suspended` 1), so calls of modules both wrap (the shared embedding and LM head)
  // go to the innermost pass alone. Zero cost per call: the wrappers read `capturing` as ever.
  int suspended;
  std::vector<CaptureState*>* held;  // the states this one's open pass suspended (owned), resumed at its end
  // id() of the model whose root forward opens this Dumper's passes (0: none). Two Dumpers on one
  // model (different selections) nest root in root on every forward: both capture it, as ever.
  unsigned long long root_key;
};

// The states whose wrappers capture now (capturing 1), borrowed: a pass that opens looks here for
// the passes open on its thread (one or two entries; none outside a nested pass). GIL-guarded.
std::vector<CaptureState*> g_capturing;

// Every change of `capturing` goes through here, so g_capturing stays exact.
void set_capturing_flag(CaptureState* s, int on) {
  if (on && !s->capturing) {
    g_capturing.push_back(s);
  } else if (!on && s->capturing) {
    g_capturing.erase(std::remove(g_capturing.begin(), g_capturing.end(), s), g_capturing.end());
  }
  s->capturing = on;
}

// Whether a pass of `s` opened now on this thread would suspend `o`'s.
inline bool nests_in(CaptureState* s, CaptureState* o, unsigned long me) {
  return o != s && o->pass_thread == me && (s->root_key == 0 || o->root_key != s->root_key);
}

// Whether a pass of `s` opened now would nest in another Dumper's (root_pass then takes the Python
// path, which records the outer pass in the inner one's metadata).
bool would_nest(CaptureState* s) {
  if (g_capturing.empty()) return false;
  const unsigned long me = PyThread_get_thread_ident();
  for (CaptureState* o : g_capturing)
    if (nests_in(s, o, me)) return true;
  return false;
}

// A pass of `s` opens on this thread: every other state capturing on this thread (a pass this one
// nests in) is suspended until `s`'s pass ends (resume_held).
void suspend_others(CaptureState* s) {
  if (g_capturing.empty()) return;
  const unsigned long me = PyThread_get_thread_ident();
  for (size_t i = 0; i < g_capturing.size();) {
    CaptureState* o = g_capturing[i];
    if (!nests_in(s, o, me)) {
      ++i;
      continue;
    }
    g_capturing.erase(g_capturing.begin() + static_cast<std::ptrdiff_t>(i));
    o->capturing = 0;
    o->suspended = 1;
    s->held->push_back(reinterpret_cast<CaptureState*>(Py_NewRef(reinterpret_cast<PyObject*>(o))));
  }
}

// `s`'s pass ended: the passes it suspended capture again, unless they ended (or stopped) meanwhile.
void resume_held(CaptureState* s) {
  if (s->held == nullptr || s->held->empty()) return;
  std::vector<CaptureState*> held;
  held.swap(*s->held);
  for (CaptureState* o : held) {
    if (o->suspended) {
      o->suspended = 0;
      set_capturing_flag(o, 1);  // (serial, pass_thread unchanged: the same pass goes on)
    }
  }
  for (CaptureState* o : held) Py_DECREF(reinterpret_cast<PyObject*>(o));
}

struct ForwardWrapper {
  PyObject_HEAD
  CaptureState* state;
  PyObject* forward;
  PyObject* owner;        // the module whose class forward `forward` is bound from, or nullptr
  PyObject* owner_func;   // what the class's `forward` attribute was when `forward` was bound
  unsigned int type_tag;  // Py_TYPE(owner)->tp_version_tag then (0: none; then looked up per call)
  PyObject* name;  // interned
  int inputs;
  PyObject* dict;
  PyObject* weaklist;  // weak references work as they do to the Python function it replaces
  vectorcallfunc vectorcall;
  // Slot 0: `name`; slot i + 1: `name.i`. Ids are -1 until the Dumper has given one.
  std::vector<PyObject*>* names;
  std::vector<int64_t>* ids;
};

// -- CaptureState -----------------------------------------------------------------------------------

int state_traverse(CaptureState* s, visitproc visit, void* arg) {
  Py_VISIT(s->dumper);
  Py_VISIT(s->calls);
  Py_VISIT(s->name_ids);
  Py_VISIT(s->tensor_type);
  Py_VISIT(s->lane);
  Py_VISIT(s->dynamo_probe);
  Py_VISIT(s->dynamo_outside);
  if (s->held != nullptr)
    for (CaptureState* o : *s->held) Py_VISIT(reinterpret_cast<PyObject*>(o));
  return 0;
}

int state_clear(CaptureState* s) {
  set_capturing_flag(s, 0);
  s->suspended = 0;
  if (s->held != nullptr) {
    std::vector<CaptureState*> held;
    held.swap(*s->held);
    for (CaptureState* o : held) Py_DECREF(reinterpret_cast<PyObject*>(o));
  }
  s->lane_ptr = nullptr;
  Py_CLEAR(s->dumper);
  Py_CLEAR(s->calls);
  Py_CLEAR(s->name_ids);
  Py_CLEAR(s->tensor_type);
  Py_CLEAR(s->lane);
  Py_CLEAR(s->dynamo_probe);
  Py_CLEAR(s->dynamo_outside);
  return 0;
}

void state_dealloc(CaptureState* s) {
  PyObject_GC_UnTrack(s);
  state_clear(s);
  delete s->held;
  Py_TYPE(s)->tp_free(reinterpret_cast<PyObject*>(s));
}

PyObject* state_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"dumper", "calls", "name_ids", "tensor_type", nullptr};
  PyObject *dumper, *calls, *name_ids, *tensor_type;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!O!:CaptureState", const_cast<char**>(kwlist), &dumper,
                                   &PyDict_Type, &calls, &PyDict_Type, &name_ids, &PyType_Type, &tensor_type))
    return nullptr;
  auto* s = reinterpret_cast<CaptureState*>(type->tp_alloc(type, 0));
  if (s == nullptr) return nullptr;
  s->capturing = 0;
  s->suspended = 0;
  s->held = new std::vector<CaptureState*>();
  s->root_key = 0;
  s->serial = 0;
  s->pass_thread = 0;
  s->dumper = Py_NewRef(dumper);
  s->calls = Py_NewRef(calls);
  s->name_ids = Py_NewRef(name_ids);
  s->tensor_type = Py_NewRef(tensor_type);
  s->lane = Py_NewRef(Py_None);
  s->lane_ptr = nullptr;
  s->dynamo_probe = s->dynamo_outside = nullptr;
  s->liveness_s = 0.02;
  return reinterpret_cast<PyObject*>(s);
}

PyObject* state_get_capturing(CaptureState* s, void*) { return PyBool_FromLong(s->capturing); }

int state_set_capturing(CaptureState* s, PyObject* value, void*) {
  if (value == nullptr) {
    PyErr_SetString(PyExc_AttributeError, "capturing cannot be deleted");
    return -1;
  }
  int on = PyObject_IsTrue(value);
  if (on < 0) return -1;
  if (on && !s->capturing) s->serial++;
  if (on) s->pass_thread = PyThread_get_thread_ident();
  set_capturing_flag(s, on);
  s->suspended = 0;  // (a pass set or stopped by hand is no longer waiting for a nested one)
  s->probed = 0;
  return 0;
}

PyObject* state_get_suspended(CaptureState* s, void*) { return PyBool_FromLong(s->suspended); }

PyObject* state_get_root_key(CaptureState* s, void*) { return PyLong_FromUnsignedLongLong(s->root_key); }

int state_set_root_key(CaptureState* s, PyObject* value, void*) {
  const unsigned long long v = value ? PyLong_AsUnsignedLongLong(value) : 0;
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return -1;
  s->root_key = v;
  return 0;
}

PyObject* state_get_lane(CaptureState* s, void*) { return Py_NewRef(s->lane); }

// state.lane = the channel's ChannelStager (its stage_tensor is the hot path), or None.
int state_set_lane(CaptureState* s, PyObject* value, void*) {
  if (value == nullptr) value = Py_None;
  void* ptr = nullptr;
  if (value != Py_None) {
    try {
      ptr = channel_stager_ptr(value);
    } catch (py::error_already_set& e) {
      e.restore();
      return -1;
    } catch (const std::exception& e) {
      PyErr_Format(PyExc_TypeError, "lane must be a ChannelStager or None (%s)", e.what());
      return -1;
    }
  }
  Py_SETREF(s->lane, Py_NewRef(value));
  s->lane_ptr = ptr;
  return 0;
}

PyObject* state_get_dynamo(CaptureState* s, void*) {
  if (s->dynamo_probe == nullptr) Py_RETURN_NONE;
  return PyTuple_Pack(2, s->dynamo_probe, s->dynamo_outside);
}

int state_set_dynamo(CaptureState* s, PyObject* value, void*) {
  PyObject *probe = nullptr, *outside = nullptr;
  if (value != nullptr && value != Py_None) {
    if (!PyTuple_Check(value) || PyTuple_GET_SIZE(value) != 2 || !PyCallable_Check(PyTuple_GET_ITEM(value, 0)) ||
        !PyCallable_Check(PyTuple_GET_ITEM(value, 1))) {
      PyErr_SetString(PyExc_TypeError, "dynamo must be None or (probe, outside), two callables");
      return -1;
    }
    probe = Py_NewRef(PyTuple_GET_ITEM(value, 0));
    outside = Py_NewRef(PyTuple_GET_ITEM(value, 1));
  }
  Py_XSETREF(s->dynamo_probe, probe);
  Py_XSETREF(s->dynamo_outside, outside);
  return 0;
}

PyObject* state_get_liveness(CaptureState* s, void*) { return PyFloat_FromDouble(s->liveness_s); }

int state_set_liveness(CaptureState* s, PyObject* value, void*) {
  const double v = value ? PyFloat_AsDouble(value) : -1.0;
  if (v == -1.0 && PyErr_Occurred()) return -1;
  if (!(v >= 0)) {
    PyErr_SetString(PyExc_ValueError, "liveness_s must be a number of seconds >= 0");
    return -1;
  }
  s->liveness_s = v;
  return 0;
}

PyGetSetDef state_getset[] = {
    {"liveness_s", reinterpret_cast<getter>(state_get_liveness), reinterpret_cast<setter>(state_set_liveness),
     "root_pass opens a pass itself only when the writer was seen alive this recently (seconds)", nullptr},
    {"dynamo", reinterpret_cast<getter>(state_get_dynamo), reinterpret_cast<setter>(state_set_dynamo),
     "(probe, outside): how Python fallbacks stay outside a torch.compile trace, or None", nullptr},
    {"capturing", reinterpret_cast<getter>(state_get_capturing), reinterpret_cast<setter>(state_set_capturing),
     "inside a selected pass: the wrappers' only check outside one", nullptr},
    {"root_key", reinterpret_cast<getter>(state_get_root_key), reinterpret_cast<setter>(state_set_root_key),
     "id() of the model whose root forward opens the passes (0: none): passes of two Dumpers on one root do "
     "not suspend each other",
     nullptr},
    {"suspended", reinterpret_cast<getter>(state_get_suspended), nullptr,
     "in a selected pass, inside which another Dumper's pass is open on its thread (its wrappers pass through)",
     nullptr},
    {"lane", reinterpret_cast<getter>(state_get_lane), reinterpret_cast<setter>(state_set_lane),
     "the channel's ChannelStager (stage_tensor), or None: every tensor takes the Python path", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"  // the slots are set in bind_forward_wrapper
PyTypeObject CaptureStateType = {PyVarObject_HEAD_INIT(nullptr, 0)};
#pragma GCC diagnostic pop

// -- ForwardWrapper: the Python fallbacks -------------------------------------------------------------

// 1: Dynamo would trace a Python frame started now (torch.compile); 0: not; -1: error set.
int dynamo_tracing(CaptureState* st) {
  if (st->dynamo_probe == nullptr) return 0;
  PyObject* callback = PyObject_CallNoArgs(st->dynamo_probe);
  if (callback == nullptr) return -1;
  const int tracing = callback != Py_None;
  Py_DECREF(callback);
  return tracing;
}

// dumper.<method>(*argv) (argv[0] is the dumper), kept outside any torch.compile trace.
PyObject* call_method(CaptureState* st, PyObject* method, PyObject** argv, size_t n) {
  if (st->dynamo_probe != nullptr) {
    const int tracing = dynamo_tracing(st);
    if (tracing < 0) return nullptr;
    if (tracing) {
      PyObject* bound = PyObject_GetAttr(st->dumper, method);
      if (bound == nullptr) return nullptr;
      PyObject* args[8] = {nullptr, bound};
      for (size_t i = 1; i < n; ++i) args[i + 1] = argv[i];
      PyObject* r = PyObject_Vectorcall(st->dynamo_outside, args + 1, n | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
      Py_DECREF(bound);
      return r;
    }
  }
  return PyObject_VectorcallMethod(method, argv, n | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
}

// The pending exception as one object (normalized, with its traceback); nullptr when none.
PyObject* fetch_exception() {
#if PY_VERSION_HEX >= 0x030C0000
  return PyErr_GetRaisedException();
#else
  PyObject *type, *exc, *tb;
  PyErr_Fetch(&type, &exc, &tb);
  PyErr_NormalizeException(&type, &exc, &tb);
  if (tb != nullptr && exc != nullptr) PyException_SetTraceback(exc, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return exc;
#endif
}

// The pending exception (an Exception, not KeyboardInterrupt & co., which propagate as from the
// Python wrapper) goes to Dumper._capture_failed(name, value, exc): recorded as a skip, never
// raised into the model. Returns -1 when a BaseException must propagate.
int absorb_error(CaptureState* st, PyObject* name, PyObject* value) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
  PyObject* exc = fetch_exception();
  PyObject* argv[] = {st->dumper, name, value, exc ? exc : Py_None};
  PyObject* r = call_method(st, s_capture_failed, argv, 4);
  Py_XDECREF(exc);
  if (r != nullptr) {
    Py_DECREF(r);
    return 0;
  }
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
  // Recording the failure failed too: say so on stderr (sys.unraisablehook), never to the model.
  PyErr_WriteUnraisable(st->dumper);
  return 0;
}

// dumper.<method>(name, value[, extra[, more]]) with errors absorbed; -1 only for a propagating
// BaseException.
int call_dumper(CaptureState* st, PyObject* method, PyObject* name, PyObject* value, PyObject* extra = nullptr,
                PyObject* more = nullptr) {
  PyObject* argv[] = {st->dumper, name, value, extra, more};
  size_t n = more ? 5 : extra ? 4 : 3;
  PyObject* r = call_method(st, method, argv, n);
  if (r != nullptr) {
    Py_DECREF(r);
    return 0;
  }
  return absorb_error(st, name, value);
}

// -- ForwardWrapper: staging ------------------------------------------------------------------------------

// The name of slot `slot` (0: name, i + 1: name.i), made and interned once.
PyObject* slot_name(ForwardWrapper* w, size_t slot) {
  auto& names = *w->names;
  if (slot >= names.size()) {
    names.resize(slot + 1, nullptr);
    w->ids->resize(slot + 1, -1);
  }
  if (names[slot] == nullptr) {
    PyObject* s = slot == 0 ? Py_NewRef(w->name)
                            : PyUnicode_FromFormat("%U.%zd", w->name, static_cast<Py_ssize_t>(slot - 1));
    if (s == nullptr) return nullptr;
    PyUnicode_InternInPlace(&s);
    names[slot] = s;
  }
  return names[slot];
}

// Stages one exact tensor under slot `slot`'s name. -1 only for a propagating BaseException.
int stage_one(ForwardWrapper* w, size_t slot, PyObject* t) {
  CaptureState* st = w->state;
  PyObject* name = slot_name(w, slot);
  if (name == nullptr) return absorb_error(st, w->name, t);
  int64_t id = (*w->ids)[slot];
  if (id < 0) {  // ask the Dumper's dict: ids are given by Dumper._name_id (Python, once per name)
    PyObject* found = PyDict_GetItemWithError(st->name_ids, name);  // borrowed
    if (found != nullptr && PyLong_CheckExact(found)) {
      id = PyLong_AsLongLong(found);
      if (id < 0 || id > UINT32_MAX) {
        PyErr_Clear();
        id = -1;
      } else {
        (*w->ids)[slot] = id;
      }
    } else if (PyErr_Occurred()) {
      return absorb_error(st, name, t);
    }
  }
  if (id < 0 || st->lane_ptr == nullptr) return call_dumper(st, s_stage, name, t);  // gives the id
  // Held for the call: stage_tensor may release the GIL (large copies) and the lane be replaced.
  PyObject* lane = Py_NewRef(st->lane);
  void* lane_ptr = st->lane_ptr;
  int status;
  try {
    status = stage_tensor_on(lane_ptr, static_cast<uint32_t>(id), t);
  } catch (py::error_already_set& e) {
    e.restore();
    status = INT32_MIN;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    status = INT32_MIN;
  }
  Py_DECREF(lane);
  if (status == kStaged) return 0;
  if (status == INT32_MIN) {  // the Python path stages it again or records why not
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyErr_Clear();
    return call_dumper(st, s_stage, name, t);
  }
  PyObject* code = PyLong_FromLong(status);
  if (code == nullptr) return absorb_error(st, name, t);
  int r = call_dumper(st, s_fast_status, name, t, code);
  Py_DECREF(code);
  return r;
}

// An output the C path stages: an exact tensor, or a tuple/list of exact tensors and Nones holding
// at least one tensor. One holding none (`(None, None)`, `()`) goes to Python, which records its
// structure (Dumper._structure): its names alone would not say it was returned.
bool plain_output(PyObject* out, PyObject* tensor_type) {
  if (Py_TYPE(out) == reinterpret_cast<PyTypeObject*>(tensor_type)) return true;
  if (!PyTuple_CheckExact(out) && !PyList_CheckExact(out)) return false;
  const Py_ssize_t n = Py_SIZE(out);
  if (n > kMaxFastElements) return false;
  PyObject** items = PySequence_Fast_ITEMS(out);
  bool any = false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (items[i] == Py_None) continue;
    if (Py_TYPE(items[i]) != reinterpret_cast<PyTypeObject*>(tensor_type)) return false;
    any = true;
  }
  return any;
}

// The number of a call of `name` starting now in this pass (Dumper._claim's twin): calls[name] is
// the count of calls started so far. -1: not numbered (the error went to _capture_failed; the
// output is numbered when it returns); -2: a BaseException propagates.
Py_ssize_t claim_call(CaptureState* st, PyObject* name) {
  // A module shared with another model (an EAGLE draft's embedding) or called from a worker thread
  // runs here while this Dumper's pass is open on another thread: its tensors join the pass, which
  // is then marked mixed (verify fails) rather than silently holding another forward's values.
  // (The Dumper marks a pass mixed once; calls after that cost it an attribute test.)
  if (PyThread_get_thread_ident() != st->pass_thread) {
    PyObject* argv[] = {st->dumper};
    PyObject* r = call_method(st, s_check_thread, argv, 1);
    if (r == nullptr && absorb_error(st, name, Py_None) < 0) return -2;
    Py_XDECREF(r);
  }
  // A module's first call of the pass (nearly every call: calls is cleared per pass) costs one dict
  // operation: setdefault(name, 1) inserts the count and leaves the dict one larger. Only a name
  // already there (a later call) is read and set again. (A look-up then an insert cost ~120 more
  // instructions per dumped tensor: benchmarks/RESULTS.md 0w.)
  const Py_ssize_t before = PyDict_GET_SIZE(st->calls);
  PyObject* started = PyDict_SetDefault(st->calls, name, s_one);  // borrowed
  if (started == nullptr) return absorb_error(st, name, Py_None) < 0 ? -2 : -1;
  if (PyDict_GET_SIZE(st->calls) != before) return 0;  // inserted: the first call, now counted
  const Py_ssize_t k = PyLong_Check(started) ? PyLong_AsSsize_t(started) : -1;
  if (k < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "fastdump: a call count is not a count");
    return absorb_error(st, name, Py_None) < 0 ? -2 : -1;
  }
  PyObject* next = k == 0 ? Py_NewRef(s_one) : PyLong_FromSsize_t(k + 1);
  const int failed = next == nullptr || PyDict_SetItem(st->calls, name, next) < 0;
  Py_XDECREF(next);
  if (failed) return absorb_error(st, name, Py_None) < 0 ? -2 : -1;
  return k;
}

// After forward returned `out` in a pass, for the call numbered `k` when it started (-1: number it
// now). -1 only for a propagating BaseException.
int capture_output(ForwardWrapper* w, PyObject* out, Py_ssize_t k) {
  CaptureState* st = w->state;
  if (k != 0 || !plain_output(out, st->tensor_type)) {  // another output or call (name#k): Python
    if (k < 0) return call_dumper(st, s_capture, w->name, out);
    PyObject* number = PyLong_FromSsize_t(k);
    if (number == nullptr) return absorb_error(st, w->name, out);
    const int r = call_dumper(st, s_capture, w->name, out, Py_None, number);
    Py_DECREF(number);
    return r;
  }
  if (Py_TYPE(out) == reinterpret_cast<PyTypeObject*>(st->tensor_type)) return stage_one(w, 0, out);
  Py_INCREF(out);
  int r = 0;
  // Py_SIZE each time: a list could change while Python fallbacks run (not by fastdump, but safely).
  for (Py_ssize_t i = 0; i < Py_SIZE(out) && r == 0 && st->capturing; ++i) {
    PyObject* item = PySequence_Fast_ITEMS(out)[i];
    if (item == Py_None) continue;
    Py_INCREF(item);
    if (Py_TYPE(item) == reinterpret_cast<PyTypeObject*>(st->tensor_type)) {
      r = stage_one(w, static_cast<size_t>(i) + 1, item);
    } else {  // a list element replaced meanwhile (never by fastdump): the general path for it
      PyObject* name = slot_name(w, static_cast<size_t>(i) + 1);
      r = name ? call_dumper(st, s_emit_safely, name, item) : absorb_error(st, w->name, item);
    }
    Py_DECREF(item);
  }
  Py_DECREF(out);
  return r;
}

// dumper._capture_inputs(name, args, kwargs, k), before forward (it may change its inputs in place).
int capture_inputs(ForwardWrapper* w, PyObject* const* args, size_t nargsf, PyObject* kwnames, Py_ssize_t k) {
  CaptureState* st = w->state;
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  PyObject* tuple = PyTuple_New(nargs);
  PyObject* kwargs = PyDict_New();
  int r = 0;
  if (tuple == nullptr || kwargs == nullptr) {
    r = absorb_error(st, w->name, Py_None);
  } else {
    for (Py_ssize_t i = 0; i < nargs; ++i) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw && r == 0; ++i) {
      if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
        r = absorb_error(st, w->name, Py_None);
    }
    if (r == 0) {
      PyObject* number = k >= 0 ? PyLong_FromSsize_t(k) : Py_NewRef(Py_None);
      r = number ? call_dumper(st, s_capture_inputs, w->name, tuple, kwargs, number) : absorb_error(st, w->name, Py_None);
      Py_XDECREF(number);
    }
  }
  Py_XDECREF(tuple);
  Py_XDECREF(kwargs);
  return r;
}

PyObject* s_forward;  // "forward"

// The owner's class forward, bound to the owner, when it is not what `forward` was bound from
// (the class was patched, or a base class's forward changed). Never raises: on any failure the
// wrapper keeps calling what it has.
void follow_class_forward(ForwardWrapper* w) {
  PyTypeObject* type = Py_TYPE(w->owner);
  PyObject* func = _PyType_Lookup(type, s_forward);  // borrowed; assigns the type a version tag
  w->type_tag = type->tp_version_tag;
  if (func == nullptr || func == w->owner_func) return;
  PyObject* bound;
  if (PyFunction_Check(func)) {
    bound = PyMethod_New(func, w->owner);
  } else if (Py_TYPE(func)->tp_descr_get != nullptr) {
    bound = Py_TYPE(func)->tp_descr_get(func, w->owner, reinterpret_cast<PyObject*>(type));
  } else {
    bound = Py_NewRef(func);
  }
  if (bound == nullptr) {
    PyErr_Clear();
    return;
  }
  Py_SETREF(w->forward, bound);
  Py_SETREF(w->owner_func, Py_NewRef(func));
}

inline void check_owner(ForwardWrapper* w) {
  if (w->owner != nullptr && (Py_TYPE(w->owner)->tp_version_tag != w->type_tag || w->type_tag == 0))
    follow_class_forward(w);
}

PyObject* capture_call(ForwardWrapper* w, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  Py_INCREF(w);  // forward may unwrap the module (dropping the last other reference to us)
  PyObject* out = nullptr;
  CaptureState* st = w->state;
  if (!st->probed) {
    // Once per pass: a model compiled without the root wrapper seeing it (a compiled submodule,
    // manual passes) gets the Python wrappers, which Dynamo inlines (Dumper._use_python_wrappers).
    st->probed = 1;
    const int tracing = dynamo_tracing(st);
    PyObject* argv[] = {st->dumper};
    PyObject* r = tracing > 0 ? call_method(st, s_use_python, argv, 1) : nullptr;
    if (tracing != 0 && r == nullptr && absorb_error(st, w->name, Py_None) < 0) goto done;
    Py_XDECREF(r);
  }
  {
    const Py_ssize_t k = claim_call(st, w->name);
    if (k == -2) goto done;
    const uint64_t serial = st->serial;
    if (w->inputs && capture_inputs(w, args, nargsf, kwnames, k) < 0) goto done;
    out = PyObject_Vectorcall(w->forward, args, nargsf, kwnames);
    // A pass that ended (and another that began) inside the call: number the output in the new one.
    if (out != nullptr && st->capturing && capture_output(w, out, st->serial == serial ? k : -1) < 0) Py_CLEAR(out);
  }
done:
  Py_DECREF(w);
  return out;
}

PyObject* wrapper_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* w = reinterpret_cast<ForwardWrapper*>(self);
  if (w->forward == nullptr) {  // cleared by the garbage collector (a cycle being freed)
    PyErr_SetString(PyExc_RuntimeError, "fastdump forward wrapper called after it was cleared");
    return nullptr;
  }
  check_owner(w);
  if (!w->state->capturing) return PyObject_Vectorcall(w->forward, args, nargsf, kwnames);
  return capture_call(w, args, nargsf, kwnames);
}

// -- CaptureState.root_pass: a root forward's pass, begin and end in C ---------------------------------
//
// Issue 11: a root forward's pass begin and end in Python (Dumper._root_begin, _begin, Channel.begin,
// the engine's liveness property, _end, Channel.end: a dozen frames, properties and pybind calls) cost
// a small model's decode loop 40-110 us a pass, nearly all of it cache and TLB misses: the model's
// kernels evict everything between two passes (benchmarks/RESULTS.md 0l). root_pass does the
// common case in one C call: a pass with no metadata, skips, budget, stall or graph capture, opened
// and closed with the lane's plain records. The selection (every, skip_passes, pass_range) is made
// here too: a pass it leaves out needs no record, only the Dumper's pass state, unless a CUDA graph
// is being captured (asked of GraphRecording.capture_running, the one Python call, made before any
// attribute is read for good). Each side first reads the Dumper's attributes and changes nothing
// unless its record went into the ring (or none was needed); then it sets them as the Python methods
// do, with no Python code in between (no other thread or signal can get in). Every other case runs
// the Python methods, unchanged.

// Raises `exc` again (the reference is stolen).
void restore_exception(PyObject* exc) {
  if (exc == nullptr) return;
#if PY_VERSION_HEX >= 0x030C0000
  PyErr_SetRaisedException(exc);
#else
  PyErr_Restore(Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(exc))), exc, PyException_GetTraceback(exc));
#endif
}

// A handler raised while `exc` (owned) was being handled: as in Python, its exception replaces
// exc, which becomes its __context__.
PyObject* replace_exception(PyObject* exc) {
  PyObject* now = fetch_exception();
  if (now == nullptr) return exc;
  if (exc != nullptr && exc != now) {
    PyException_SetContext(now, exc);  // steals exc
  } else {
    Py_XDECREF(exc);
  }
  return now;
}

struct PassNames {
  PyObject *depth, *closed, *engine, *status, *running, *next_meta, *meta, *open_calls, *skipped, *skip_passes,
      *every, *pass_range, *max_bytes, *channel, *block, *policy_block, *stalled, *block_timeout_s, *pass_dropped,
      *pass_thread, *incomplete, *mixed, *pass_id, *root_opener, *manual_opener, *graphs, *open, *totals, *passes,
      *unconfirmed, *append, *root_begin, *end, *forward_raised, *trim_unconfirmed, *channel_engine, *late_ends,
      *standalone_passes, *capture_running, *structure, *zero;
};
PassNames n;

bool init_pass_names() {
  struct { PyObject** slot; const char* text; } names[] = {
      {&n.depth, "_depth"}, {&n.closed, "_closed"}, {&n.engine, "_engine"}, {&n.status, "status"},
      {&n.running, "running"}, {&n.next_meta, "_next_meta"}, {&n.meta, "_meta"}, {&n.open_calls, "_open_calls"},
      {&n.skipped, "_skipped"}, {&n.skip_passes, "skip_passes"}, {&n.every, "every"}, {&n.pass_range, "pass_range"},
      {&n.max_bytes, "max_bytes"}, {&n.channel, "_channel"}, {&n.block, "block"}, {&n.policy_block, "policy_block"},
      {&n.stalled, "stalled"}, {&n.block_timeout_s, "block_timeout_s"}, {&n.pass_dropped, "pass_dropped"},
      {&n.pass_thread, "_pass_thread"}, {&n.incomplete, "_incomplete"}, {&n.mixed, "_mixed"},
      {&n.pass_id, "pass_id"}, {&n.root_opener, "_root_opener"}, {&n.manual_opener, "_manual_opener"},
      {&n.graphs, "_graphs"}, {&n.open, "open"}, {&n.totals, "_totals"}, {&n.passes, "passes"},
      {&n.unconfirmed, "_unconfirmed"}, {&n.append, "append"}, {&n.root_begin, "_root_begin"}, {&n.end, "_end"},
      {&n.forward_raised, "_forward_raised"}, {&n.trim_unconfirmed, "_trim_unconfirmed"},
      {&n.channel_engine, "engine"}, {&n.late_ends, "_late_ends"}, {&n.standalone_passes, "_standalone_passes"},
      {&n.capture_running, "capture_running"}, {&n.structure, "_structure"}};
  for (auto& name : names) {
    *name.slot = PyUnicode_InternFromString(name.text);
    if (*name.slot == nullptr) return false;
  }
  n.zero = PyLong_FromLong(0);
  return n.zero != nullptr;
}

// An owned reference, released at scope exit.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

// obj.name as a new reference; nullptr, with no error left set, when it cannot be read (then the
// fast path does not apply and the Python method meets the same attribute).
PyObject* read(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

bool int_of(PyObject* v, long long* out) {
  if (v == nullptr || !PyLong_CheckExact(v)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (*out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return overflow == 0;
}

bool is_int(PyObject* v, long long want) {
  long long x;
  return int_of(v, &x) && x == want;
}

bool empty_dict(PyObject* v) { return v != nullptr && PyDict_CheckExact(v) && PyDict_GET_SIZE(v) == 0; }

// state.capturing = True, as its setter does it.
void start_capturing(CaptureState* st) {
  if (!st->capturing) st->serial++;
  st->pass_thread = PyThread_get_thread_ident();
  set_capturing_flag(st, 1);
  st->suspended = 0;
  st->probed = 0;
}

// Dumper._selected for root forward `next` (every, skip_passes, pass_range; no byte budget): 1 dumped,
// 0 left out, -1 not readable here (the caller takes the Python path).
int root_selected(PyObject* d, long long next) {
  Ref skip(read(d, n.skip_passes)), every(read(d, n.every)), range(read(d, n.pass_range)),
      standalone(read(d, n.standalone_passes));
  long long skip_n, every_n, standalone_n, lo = 0, hi = LLONG_MAX;
  if (!int_of(skip.p, &skip_n) || !int_of(every.p, &every_n) || !int_of(standalone.p, &standalone_n) ||
      skip_n < 0 || every_n < 1 || standalone_n < 0 || standalone_n > next || range.p == nullptr)
    return -1;
  if (range.p != Py_None) {
    if (!PyTuple_CheckExact(range.p) || PyTuple_GET_SIZE(range.p) != 2 || !int_of(PyTuple_GET_ITEM(range.p, 0), &lo) ||
        !int_of(PyTuple_GET_ITEM(range.p, 1), &hi))
      return -1;
  }
  const long long counted = next - standalone_n;  // dump() calls outside a pass are not counted
  return counted >= skip_n && (counted - skip_n) % every_n == 0 && lo <= counted && counted < hi;
}

// 1: this call opened the pass: its plain begin record is in the ring (a pass the selection keeps),
// or none is needed (a pass it leaves out, with no CUDA graph being captured); 0: not a plain pass,
// or no room for its record now, and nothing was changed: the caller runs Dumper._root_begin; -1:
// setting the Dumper's attributes failed (a MemoryError), which propagates.
int root_begin_fast(CaptureState* st) {
  if (st->capturing || st->lane_ptr == nullptr || would_nest(st)) return 0;
  PyObject* d = st->dumper;
  long long previous;
  {
    Ref pass_id(read(d, n.pass_id));
    if (!int_of(pass_id.p, &previous) || previous == LLONG_MAX) return 0;
  }
  const int selected = root_selected(d, previous + 1);
  if (selected < 0) return 0;
  if (selected == 0) {  // left out, unless a CUDA graph is being captured (GraphRecording: Python)
    Ref graphs(read(d, n.graphs));
    if (graphs.p == nullptr) return 0;
    if (graphs.p != Py_None) {
      Ref running(PyObject_CallMethodNoArgs(graphs.p, n.capture_running));
      if (running.p == nullptr) PyErr_Clear();
      if (running.p != Py_False) return 0;
    }
    // (Python ran: what was read above is read again below, and the pass id must not have moved.)
  }
  Ref depth(read(d, n.depth)), closed(read(d, n.closed)), engine(read(d, n.engine)), status(read(d, n.status));
  if (!is_int(depth.p, 0) || closed.p != Py_False || engine.p == nullptr || engine.p == Py_None ||
      status.p == nullptr || !PyUnicode_CheckExact(status.p) || PyUnicode_Compare(status.p, n.running) != 0)
    return 0;
  Ref next_meta(read(d, n.next_meta)), open_calls(read(d, n.open_calls)), skipped(read(d, n.skipped)),
      structure(read(d, n.structure)), late_ends(read(d, n.late_ends));
  if (!empty_dict(next_meta.p) || open_calls.p == nullptr || !PyList_CheckExact(open_calls.p) ||
      PyList_GET_SIZE(open_calls.p) != 0 || !empty_dict(skipped.p) || !empty_dict(structure.p))
    return 0;
  // Pass ends a full ring refused wait to be sent again (Dumper._send_late_ends, after the begin).
  if (late_ends.p == nullptr || !PyList_CheckExact(late_ends.p) || PyList_GET_SIZE(late_ends.p) != 0) return 0;
  Ref budget(read(d, n.max_bytes));
  if (budget.p != Py_None) return 0;
  Ref channel(read(d, n.channel));
  if (channel.p == nullptr || channel.p == Py_None) return 0;
  Ref block(read(channel.p, n.block)), policy(read(channel.p, n.policy_block)), timeout(read(channel.p, n.block_timeout_s));
  if ((block.p != Py_True && block.p != Py_False) || block.p != policy.p || timeout.p == nullptr) return 0;
  if (policy.p == Py_True) {  // (a stalled writer: Channel.begin decides whether to block again)
    Ref channel_engine(read(channel.p, n.channel_engine));
    Ref stalled(channel_engine.p ? read(channel_engine.p, n.stalled) : nullptr);
    if (stalled.p != Py_False) return 0;
  }
  const double timeout_s = PyFloat_AsDouble(timeout.p);
  if (timeout_s == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  Ref pass_id(read(d, n.pass_id));
  long long now;
  if (!int_of(pass_id.p, &now) || now != previous) return 0;
  const long long next = previous + 1;
  if (selected) {
    try {  // C++ only from here to the record: the writer seen alive lately, then the plain begin
      if (!lane_writer_seen_alive(st->lane_ptr, st->liveness_s)) return 0;  // Python disables the Dumper
      if (lane_open_pass(st->lane_ptr, next, block.p == Py_True, timeout_s) == 0) return 0;
    } catch (const std::exception&) {
      return 0;
    }
  }
  // The pass is open (in the ring, when kept). The attributes _root_begin, _begin and Channel.begin
  // set, in their order; what they replace is released at the end (a __del__ could let another thread in).
  PyObject* frame = reinterpret_cast<PyObject*>(PyEval_GetFrame());  // borrowed: forward_in_pass's
  Ref old_opener(read(d, n.root_opener)), old_meta(read(d, n.meta));
  Ref me(PyLong_FromUnsignedLong(PyThread_get_thread_ident())), next_id(PyLong_FromLongLong(next)),
      fresh(PyDict_New());
  if (me.p == nullptr || next_id.p == nullptr || fresh.p == nullptr) return -1;
  if (PyObject_SetAttr(d, n.root_opener, frame ? frame : Py_None) < 0 || PyObject_SetAttr(d, n.depth, s_one) < 0 ||
      PyObject_SetAttr(d, n.pass_thread, me.p) < 0 || PyObject_SetAttr(d, n.incomplete, Py_None) < 0 ||
      PyObject_SetAttr(d, n.mixed, Py_False) < 0 || PyObject_SetAttr(d, n.pass_id, next_id.p) < 0 ||
      PyObject_SetAttr(d, n.meta, next_meta.p) < 0 || PyObject_SetAttr(d, n.next_meta, fresh.p) < 0)
    return -1;
  PyDict_Clear(st->calls);
  suspend_others(st);  // (nothing to suspend: would_nest said so; kept as _begin's twin)
  if (!selected) return 1;  // (nothing captured: as _begin returns for a pass it leaves out)
  if (PyObject_SetAttr(channel.p, n.pass_dropped, n.zero) < 0) return -1;
  start_capturing(st);
  return 1;
}

// 1: this call ended the pass (its plain end record is in the ring); 0: not a plain end, or no room
// for its record now, and nothing was changed: the caller runs Dumper._end; -1: an error propagates
// (the pass has ended).
int root_end_fast(CaptureState* st) {
  if (st->lane_ptr == nullptr || st->suspended) return 0;  // (suspended: its end goes through _end)
  PyObject* d = st->dumper;
  if (!st->capturing) {  // a pass left out (or not dumping): what _end does when nothing was captured
    Ref depth(read(d, n.depth));
    if (!is_int(depth.p, 1)) return 0;
    Ref old_root(read(d, n.root_opener)), old_manual(read(d, n.manual_opener));  // (released last)
    resume_held(st);
    if (PyObject_SetAttr(d, n.depth, n.zero) < 0 || PyObject_SetAttr(d, n.manual_opener, Py_None) < 0 ||
        PyObject_SetAttr(d, n.root_opener, Py_None) < 0)
      return -1;
    return 1;
  }
  Ref depth(read(d, n.depth)), incomplete(read(d, n.incomplete)), mixed(read(d, n.mixed)), meta(read(d, n.meta)),
      skipped(read(d, n.skipped)), structure(read(d, n.structure)), budget(read(d, n.max_bytes)),
      graphs(read(d, n.graphs));
  if (!is_int(depth.p, 1) || incomplete.p != Py_None || mixed.p != Py_False || !empty_dict(meta.p) ||
      !empty_dict(skipped.p) || !empty_dict(structure.p) || budget.p != Py_None || graphs.p == nullptr)
    return 0;
  if (graphs.p != Py_None) {  // a graph captured in this pass: GraphRecording.end_pass (Python)
    Ref open(read(graphs.p, n.open));
    if (open.p != Py_None) return 0;
  }
  Ref channel(read(d, n.channel)), pass_id(read(d, n.pass_id)), totals(read(d, n.totals)),
      unconfirmed(read(d, n.unconfirmed));
  Ref dropped(channel.p && channel.p != Py_None ? read(channel.p, n.pass_dropped) : nullptr);
  long long pass, drops, passes;
  if (!int_of(pass_id.p, &pass) || !int_of(dropped.p, &drops) || drops < 0 || totals.p == nullptr ||
      !PyDict_CheckExact(totals.p) || unconfirmed.p == nullptr)
    return 0;
  PyObject* counted = PyDict_GetItemWithError(totals.p, n.passes);  // borrowed
  if (!int_of(counted, &passes) || passes == LLONG_MAX) {
    PyErr_Clear();
    return 0;
  }
  uint64_t seq;
  try {  // C++ only: the CUDA lane's pass ends, then the plain end record
    seq = lane_put_plain_end(st->lane_ptr, pass, static_cast<uint64_t>(drops));
  } catch (const std::exception&) {
    return 0;
  }
  if (seq == 0) return 0;
  // The end is in the ring: what _end sets.
  set_capturing_flag(st, 0);
  st->probed = 0;
  resume_held(st);
  Ref old_opener(read(d, n.root_opener));
  Ref count(PyLong_FromLongLong(passes + 1)), seq_obj(PyLong_FromUnsignedLongLong(seq));
  if (count.p == nullptr || seq_obj.p == nullptr) return -1;
  if (PyObject_SetAttr(d, n.depth, n.zero) < 0 || PyObject_SetAttr(d, n.manual_opener, Py_None) < 0 ||
      PyObject_SetAttr(d, n.root_opener, Py_None) < 0 || PyDict_SetItem(totals.p, n.passes, count.p) < 0)
    return -1;
  Ref appended(PyObject_CallMethodOneArg(unconfirmed.p, n.append, seq_obj.p));  // (a deque: C)
  if (appended.p == nullptr) return -1;
  const Py_ssize_t waiting = PyObject_Length(unconfirmed.p);
  if (waiting < 0) return -1;
  if (waiting > 64) {  // forget what the writer has handled (Dumper._trim_unconfirmed, now and then)
    PyObject* argv[] = {d};
    Ref r(call_method(st, n.trim_unconfirmed, argv, 1));
    if (r.p == nullptr) return -1;
  }
  return 1;
}

// state.root_pass(inner, args, kwargs): the root wrapper's pass around inner(*args, **kwargs) (the
// root's ForwardWrapper), for forward_in_pass when torch.compile is not tracing: begin, the forward,
// end, as its Python code does them, the plain case in C and every other through the Dumper's methods.
PyObject* state_root_pass(CaptureState* st, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(argv[1]) || (argv[2] != Py_None && !PyDict_Check(argv[2]))) {
    PyErr_SetString(PyExc_TypeError, "root_pass(inner, args: tuple, kwargs: dict | None)");
    return nullptr;
  }
  if (st->dumper == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "fastdump CaptureState used after it was cleared");
    return nullptr;
  }
  Py_INCREF(st);  // the forward may drop the Dumper (and its state) for good
  PyObject* d = Py_NewRef(st->dumper);
  PyObject* out = nullptr;
  PyObject* self_arg[] = {d, nullptr};
  const int began = root_begin_fast(st);
  if (began == 0) {
    PyObject* r = call_method(st, n.root_begin, self_arg, 1);
    if (r == nullptr) goto done;  // (nothing to end: as forward_in_pass, whose begin is before its try)
    Py_DECREF(r);
  } else if (began < 0) {
    goto done;
  }
  {
    PyObject* kwargs = argv[2] != Py_None && PyDict_GET_SIZE(argv[2]) ? argv[2] : nullptr;
    out = PyObject_Call(argv[0], argv[1], kwargs);
  }
  if (out == nullptr) {  // forward_in_pass's `except BaseException: _forward_raised(exc)` and `finally: _end()`
    PyObject* exc = fetch_exception();
    self_arg[1] = exc;
    PyObject* r = call_method(st, n.forward_raised, self_arg, 2);
    if (r == nullptr) exc = replace_exception(exc);
    Py_XDECREF(r);
    r = call_method(st, n.end, self_arg, 1);
    if (r == nullptr) exc = replace_exception(exc);
    Py_XDECREF(r);
    restore_exception(exc);
    goto done;
  }
  {
    const int ended = root_end_fast(st);
    PyObject* r = ended == 0 ? call_method(st, n.end, self_arg, 1) : nullptr;
    if (ended < 0 || (ended == 0 && r == nullptr)) Py_CLEAR(out);
    Py_XDECREF(r);
  }
done:
  Py_DECREF(d);
  Py_DECREF(st);
  return out;
}

// The Dumpers whose passes it suspended (a list, empty when it nests in none).
PyObject* state_suspend_others(CaptureState* st, PyObject*) {
  const size_t before = st->held->size();
  suspend_others(st);
  PyObject* dumpers = PyList_New(0);
  if (dumpers == nullptr) return nullptr;  // (they are suspended all the same; resumed at its end)
  for (size_t i = before; i < st->held->size(); ++i) {
    PyObject* d = (*st->held)[i]->dumper;
    if (d != nullptr && PyList_Append(dumpers, d) < 0) {
      Py_DECREF(dumpers);
      return nullptr;
    }
  }
  return dumpers;
}

PyObject* state_resume_held(CaptureState* st, PyObject*) {
  resume_held(st);
  Py_RETURN_NONE;
}

// Whether `other` is a state this one's open pass suspended, suspended still.
PyObject* state_holds(CaptureState* st, PyObject* other) {
  for (CaptureState* o : *st->held) {
    if (reinterpret_cast<PyObject*>(o) == other && o->suspended) Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

PyMethodDef state_methods[] = {
    {"holds", reinterpret_cast<PyCFunction>(state_holds), METH_O,
     "holds(state): this Dumper's open pass suspended `state`'s, which is suspended still"},
    {"suspend_others", reinterpret_cast<PyCFunction>(state_suspend_others), METH_NOARGS,
     "a pass of this Dumper opens: the other Dumpers' passes open on this thread stop capturing until it ends"},
    {"resume_held", reinterpret_cast<PyCFunction>(state_resume_held), METH_NOARGS,
     "this Dumper's pass ended: the passes it suspended capture again (those still open)"},
    {"root_pass", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(state_root_pass)), METH_FASTCALL,
     "root_pass(inner, args, kwargs): the root wrapper's pass around inner(*args, **kwargs)"},
    {nullptr, nullptr, 0, nullptr}};

// -- ForwardWrapper: the type -------------------------------------------------------------------------------

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"  // the slots are set in bind_forward_wrapper
PyTypeObject ForwardWrapperType = {PyVarObject_HEAD_INIT(nullptr, 0)};
#pragma GCC diagnostic pop

PyObject* wrapper_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* kwlist[] = {"state", "name", "forward", "inputs", "owner", nullptr};
  PyObject *state, *name, *forward, *owner = Py_None;
  int inputs = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!UO|pO:ForwardWrapper", const_cast<char**>(kwlist),
                                   &CaptureStateType, &state, &name, &forward, &inputs, &owner))
    return nullptr;
  if (!PyCallable_Check(forward)) {
    PyErr_SetString(PyExc_TypeError, "forward must be callable");
    return nullptr;
  }
  // Follow the owner's class forward only when `forward` is that forward bound to the owner.
  PyObject* owner_func = nullptr;
  if (owner != Py_None) {
    owner_func = _PyType_Lookup(Py_TYPE(owner), s_forward);  // borrowed
    if (owner_func == nullptr || !PyMethod_Check(forward) || PyMethod_GET_SELF(forward) != owner ||
        PyMethod_GET_FUNCTION(forward) != owner_func) {
      PyErr_SetString(PyExc_ValueError, "owner: forward is not owner's class forward bound to owner");
      return nullptr;
    }
  }
  auto* w = reinterpret_cast<ForwardWrapper*>(type->tp_alloc(type, 0));
  if (w == nullptr) return nullptr;
  w->state = reinterpret_cast<CaptureState*>(Py_NewRef(state));
  w->forward = Py_NewRef(forward);
  w->owner = owner_func != nullptr ? Py_NewRef(owner) : nullptr;
  w->owner_func = Py_XNewRef(owner_func);
  w->type_tag = owner_func != nullptr ? Py_TYPE(owner)->tp_version_tag : 0;
  Py_INCREF(name);
  PyUnicode_InternInPlace(&name);  // calls dict look-ups then compare by identity
  w->name = name;
  w->inputs = inputs;
  w->dict = nullptr;
  w->weaklist = nullptr;
  w->vectorcall = wrapper_vectorcall;
  w->names = new std::vector<PyObject*>();
  w->ids = new std::vector<int64_t>();
  return reinterpret_cast<PyObject*>(w);
}

int wrapper_traverse(ForwardWrapper* w, visitproc visit, void* arg) {
  Py_VISIT(w->state);
  Py_VISIT(w->forward);
  Py_VISIT(w->owner);
  Py_VISIT(w->owner_func);
  Py_VISIT(w->dict);
  return 0;
}

int wrapper_clear(ForwardWrapper* w) {
  Py_CLEAR(w->forward);
  Py_CLEAR(w->owner);
  Py_CLEAR(w->owner_func);
  Py_CLEAR(w->dict);
  // state is kept until dealloc: the vectorcall reads it without a check.
  return 0;
}

void wrapper_dealloc(ForwardWrapper* w) {
  PyObject_GC_UnTrack(w);
  if (w->weaklist != nullptr) PyObject_ClearWeakRefs(reinterpret_cast<PyObject*>(w));
  wrapper_clear(w);
  Py_CLEAR(w->state);
  Py_CLEAR(w->name);
  if (w->names != nullptr) {
    for (PyObject* s : *w->names) Py_XDECREF(s);
    delete w->names;
  }
  delete w->ids;
  Py_TYPE(w)->tp_free(reinterpret_cast<PyObject*>(w));
}

PyObject* wrapper_repr(ForwardWrapper* w) {
  return PyUnicode_FromFormat("<fastdump forward wrapper %R of %R>", w->name, w->forward ? w->forward : Py_None);
}

PyObject* wrapper_get_forward(ForwardWrapper* w, void*) { return Py_NewRef(w->forward ? w->forward : Py_None); }
PyObject* wrapper_get_name(ForwardWrapper* w, void*) { return Py_NewRef(w->name); }
PyObject* wrapper_get_owner(ForwardWrapper* w, void*) { return Py_NewRef(w->owner ? w->owner : Py_None); }
PyObject* wrapper_get_state(ForwardWrapper* w, void*) { return Py_NewRef(reinterpret_cast<PyObject*>(w->state)); }

PyObject* wrapper_self(PyObject* self, PyObject*) { return Py_NewRef(self); }

PyGetSetDef wrapper_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {"_fastdump_forward", reinterpret_cast<getter>(wrapper_get_forward), nullptr, "the wrapped forward", nullptr},
    {"_fastdump_name", reinterpret_cast<getter>(wrapper_get_name), nullptr, "the dumped name", nullptr},
    {"_fastdump_owner", reinterpret_cast<getter>(wrapper_get_owner), nullptr,
     "the module whose class forward it follows, or None", nullptr},
    {"_fastdump_state", reinterpret_cast<getter>(wrapper_get_state), nullptr, "its Dumper's CaptureState", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// copy/deepcopy of a model keep the wrapper itself, as they keep a Python function.
PyMethodDef wrapper_methods[] = {
    {"__copy__", wrapper_self, METH_NOARGS, nullptr},
    {"__deepcopy__", wrapper_self, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void bind_forward_wrapper(py::module_& m) {
  s_stage = PyUnicode_InternFromString("_stage");
  s_fast_status = PyUnicode_InternFromString("_fast_status");
  s_capture = PyUnicode_InternFromString("_capture");
  s_capture_inputs = PyUnicode_InternFromString("_capture_inputs");
  s_capture_failed = PyUnicode_InternFromString("_capture_failed");
  s_emit_safely = PyUnicode_InternFromString("_emit_safely");
  s_use_python = PyUnicode_InternFromString("_use_python_wrappers");
  s_check_thread = PyUnicode_InternFromString("_check_thread");
  s_one = PyLong_FromLong(1);
  s_forward = PyUnicode_InternFromString("forward");
  if (!s_forward || !s_stage || !s_fast_status || !s_capture || !s_capture_inputs || !s_capture_failed || !s_emit_safely || !s_use_python || !s_check_thread || !s_one || !init_pass_names())
    throw py::error_already_set();

  PyTypeObject& st = CaptureStateType;
  st.tp_name = "fastdump._C.CaptureState";
  st.tp_basicsize = sizeof(CaptureState);
  st.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  st.tp_doc = "CaptureState(dumper, calls, name_ids, tensor_type): one Dumper's state shared by its ForwardWrappers";
  st.tp_new = state_new;
  st.tp_dealloc = reinterpret_cast<destructor>(state_dealloc);
  st.tp_traverse = reinterpret_cast<traverseproc>(state_traverse);
  st.tp_clear = reinterpret_cast<inquiry>(state_clear);
  st.tp_getset = state_getset;
  st.tp_methods = state_methods;
  if (PyType_Ready(&st) < 0) throw py::error_already_set();

  PyTypeObject& wt = ForwardWrapperType;
  wt.tp_name = "fastdump._C.ForwardWrapper";
  wt.tp_basicsize = sizeof(ForwardWrapper);
  wt.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  wt.tp_doc = "ForwardWrapper(state, name, forward, inputs=False, owner=None): a module's forward, dumped while "
               "state.capturing; with owner, forward is owner's class forward and follows it when the class changes";
  wt.tp_new = wrapper_new;
  wt.tp_dealloc = reinterpret_cast<destructor>(wrapper_dealloc);
  wt.tp_traverse = reinterpret_cast<traverseproc>(wrapper_traverse);
  wt.tp_clear = reinterpret_cast<inquiry>(wrapper_clear);
  wt.tp_call = PyVectorcall_Call;
  wt.tp_vectorcall_offset = offsetof(ForwardWrapper, vectorcall);
  wt.tp_dictoffset = offsetof(ForwardWrapper, dict);
  wt.tp_weaklistoffset = offsetof(ForwardWrapper, weaklist);
  wt.tp_getset = wrapper_getset;
  wt.tp_methods = wrapper_methods;
  wt.tp_repr = reinterpret_cast<reprfunc>(wrapper_repr);
  if (PyType_Ready(&wt) < 0) throw py::error_already_set();

  m.attr("CaptureState") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&st));
  m.attr("ForwardWrapper") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&wt));
}

}  // namespace fastdump
