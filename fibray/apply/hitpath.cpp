// The compiled hit path of fibray.apply: guards, signature lookup, call and count in one C call.
//
// A HitPath replays decisions that the Python Dispatcher (fibray/apply/dispatch.py) already
// made for an argument signature: call this solution, or call the fallback. It checks the Python
// path's guards per call on every tensor input, and more strictly (exact tensor types, every input
// on the device). It must never decide anything itself: an input it does not recognise (a tensor
// subclass, a symbolic shape), a signature it was not told about, or a call that needs more than
// a plain call (an output check, keyword arguments, a caller passing its own outputs) goes to the
// Python dispatch unchanged. Built and loaded by fibray/apply/native.py.

#include <Python.h>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// Entry kinds, the numbers of fibray.apply.dispatch.
constexpr int HIT = 0, BUCKETED = 1, MISS = 2;

struct Decision {
  int kind = MISS;
  PyObject* fn = nullptr;     // the solution to call (owned); nullptr for MISS: call the fallback
  PyObject* state = nullptr;  // its SolutionState (owned), handed back on failure; Py_None for MISS
  size_t cell = 0;            // index of its counter in Core::cells
  bool dps = false;           // destination-passing: allocate `outs`, pass them after the inputs
  std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>> outs;  // shape and dtype of each output

  Decision() = default;
  Decision(const Decision&) = delete;
  ~Decision() {
    Py_XDECREF(fn);
    Py_XDECREF(state);
  }
};
// Shared so that a destination-passing call keeps its output specs while the Python code it runs
// clears the table.
using DecisionPtr = std::shared_ptr<const Decision>;

// The shapes of a call's tensor inputs (ndim, then sizes, per tensor), hashed as they are read.
struct Signature {
  uint64_t hash = 0;
  std::vector<int64_t> dims;

  void clear() {
    hash = 0;
    dims.clear();
  }
  void add(int64_t v) {
    dims.push_back(v);
    hash = (hash ^ static_cast<uint64_t>(v)) * 0x100000001b3ULL;  // FNV-1a step, per value
  }
  bool operator==(const Signature& other) const { return hash == other.hash && dims == other.dims; }
};

struct SignatureHash {
  size_t operator()(const Signature& s) const noexcept { return static_cast<size_t>(s.hash ^ (s.hash >> 29)); }
};

struct Cell {  // calls one (state, kind) answered since the last drain()
  PyObject* state;
  int kind;
  unsigned long long calls;
};

struct Core {
  Py_ssize_t n_in = 0;                                     // positional inputs of the definition
  std::vector<std::pair<Py_ssize_t, c10::ScalarType>> guards;  // (position, dtype) of each tensor input
  c10::DeviceType device = c10::DeviceType::CPU;           // where every tensor input must be
  bool single_output = true;
  std::unordered_map<Signature, DecisionPtr, SignatureHash> decisions;  // what Python decided
  std::vector<Cell> cells;                                 // never shrinks: indices stay valid
  Signature scratch;                                       // the signature of the call being served
};

struct HitPath {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* slow;       // slow(fallback, args, kwargs): the Python dispatch
  PyObject* on_error;   // on_error(state, exception, fallback, args, kwargs): breaker, then fallback
  PyObject* normalize;  // normalize(result): a solution's result as the fallback returns it
  Core* core;
};

// The signature of `args` into core.scratch, or false when a guard fails (dtype, layout, device,
// contiguity, autograd, or not a plain tensor): those calls are the Python path's to judge.
bool signature(Core& core, PyObject* args) {
  core.scratch.clear();
  for (const auto& [pos, dtype] : core.guards) {
    PyObject* obj = PyTuple_GET_ITEM(args, pos);
    if (!THPVariable_CheckTypeExact(Py_TYPE(obj))) return false;  // a subclass may mean something else
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.scalar_type() != dtype || t.layout() != c10::kStrided || t.device().type() != core.device) return false;
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !t.is_contiguous()) return false;
    // a kernel has no backward: never substitute under autograd (grad mode is a thread-local read)
    if (t.requires_grad() && c10::GradMode::is_enabled()) return false;
    const auto sizes = t.sizes();
    core.scratch.add(static_cast<int64_t>(sizes.size()));
    for (int64_t s : sizes) core.scratch.add(s);
  }
  return true;
}

PyObject* defer(HitPath* self, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  return PyObject_Vectorcall(self->slow, argv, nargsf, kwnames);
}

// A solution raised (or its result could not be normalised): hand the exception to Python.
PyObject* failed(HitPath* self, PyObject* state, PyObject* fallback, PyObject* args, PyObject* kwargs) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;  // KeyboardInterrupt and the like propagate
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr) PyException_SetTraceback(value, tb);
  PyObject* argv[] = {state, value, fallback, args, kwargs};
  PyObject* out = PyObject_Vectorcall(self->on_error, argv, 5, nullptr);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return out;
}

// A destination-passing solution: outputs allocated like the inputs' device, passed after them.
PyObject* call_destination_passing(const Core& core, const Decision& d, PyObject* args) {
  const Py_ssize_t n_in = core.n_in, n_out = static_cast<Py_ssize_t>(d.outs.size());
  PyObject* outs = PyTuple_New(n_out);
  if (outs == nullptr) return nullptr;
  try {
    const at::Device device = THPVariable_Unpack(PyTuple_GET_ITEM(args, core.guards[0].first)).device();
    for (Py_ssize_t k = 0; k < n_out; ++k) {
      const auto& [shape, dtype] = d.outs[k];
      PyObject* out = THPVariable_Wrap(at::empty(shape, at::TensorOptions().dtype(dtype).device(device)));
      if (out == nullptr) {
        Py_DECREF(outs);
        return nullptr;
      }
      PyTuple_SET_ITEM(outs, k, out);
    }
  } catch (const std::exception& e) {  // out of memory: a failure of this call, as in the Python path
    Py_DECREF(outs);
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  std::vector<PyObject*> argv(&PyTuple_GET_ITEM(args, 0), &PyTuple_GET_ITEM(args, 0) + n_in);
  argv.insert(argv.end(), &PyTuple_GET_ITEM(outs, 0), &PyTuple_GET_ITEM(outs, 0) + n_out);
  PyObject* ignored = PyObject_Vectorcall(d.fn, argv.data(), n_in + n_out, nullptr);
  if (ignored == nullptr) {
    Py_DECREF(outs);
    return nullptr;
  }
  Py_DECREF(ignored);
  if (n_out != 1) return outs;
  PyObject* out = PyTuple_GET_ITEM(outs, 0);
  Py_INCREF(out);
  Py_DECREF(outs);
  return out;
}

// HitPath(fallback, args, kwargs): the same call as the Python dispatch it stands in front of.
PyObject* hitpath_call(PyObject* self_, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<HitPath*>(self_);
  Core& core = *self->core;
  if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != nullptr) return defer(self, argv, nargsf, kwnames);
  PyObject *fallback = argv[0], *args = argv[1], *kwargs = argv[2];
  if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != core.n_in || !PyDict_CheckExact(kwargs) ||
      PyDict_GET_SIZE(kwargs) != 0)
    return defer(self, argv, nargsf, kwnames);
  const Decision* d;
  DecisionPtr keep;  // only a destination-passing call needs its decision after Python code ran
  try {
    if (!signature(core, args)) return defer(self, argv, nargsf, kwnames);
    auto it = core.decisions.find(core.scratch);
    if (it == core.decisions.end()) return defer(self, argv, nargsf, kwnames);
    d = it->second.get();
    if (d->dps) keep = it->second;
  } catch (const std::exception&) {  // a tensor torch itself cannot describe here (e.g. symbolic)
    return defer(self, argv, nargsf, kwnames);
  }
  // Python code runs from here on and may clear the table: hold on to what the call needs.
  PyObject* const* items = &PyTuple_GET_ITEM(args, 0);
  const size_t cell = d->cell;
  if (d->kind == MISS) {
    core.cells[cell].calls++;
    return PyObject_Vectorcall(fallback, items, core.n_in, nullptr);
  }
  PyObject* state = d->state;
  Py_INCREF(state);
  PyObject* result;
  if (keep) {
    result = call_destination_passing(core, *keep, args);
  } else {
    PyObject* fn = d->fn;
    Py_INCREF(fn);
    result = PyObject_Vectorcall(fn, items, core.n_in, nullptr);
    Py_DECREF(fn);
    if (result != nullptr && !(core.single_output && THPVariable_CheckTypeExact(Py_TYPE(result)))) {
      PyObject* normal = PyObject_CallOneArg(self->normalize, result);
      Py_DECREF(result);
      result = normal;
    }
  }
  if (result == nullptr) {
    result = failed(self, state, fallback, args, kwargs);
  } else {
    core.cells[cell].calls++;
  }
  Py_DECREF(state);
  return result;
}

// -- methods the Dispatcher uses to keep the table in step with its own ---------------------

// A shape (a sequence of ints) into `dims`.
bool read_shape(PyObject* obj, std::vector<int64_t>& dims) {
  PyObject* shape = PySequence_Fast(obj, "HitPath.put: a shape must be a sequence of ints");
  if (shape == nullptr) return false;
  for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(shape); ++j) {
    const long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(shape, j));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(shape);
      return false;
    }
    dims.push_back(v);
  }
  Py_DECREF(shape);
  return true;
}

// The signature of a call whose tensor inputs have these shapes, as signature() computes it.
bool encode(Core& core, PyObject* shapes, Signature& key) {
  if (!PyTuple_Check(shapes) || PyTuple_GET_SIZE(shapes) != static_cast<Py_ssize_t>(core.guards.size())) {
    PyErr_SetString(PyExc_ValueError, "HitPath.put: one shape per tensor input expected");
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shapes); ++i) {
    std::vector<int64_t> dims;
    if (!read_shape(PyTuple_GET_ITEM(shapes, i), dims)) return false;
    key.add(static_cast<int64_t>(dims.size()));
    for (int64_t v : dims) key.add(v);
  }
  return true;
}

// Destination-passing outputs: a sequence of (shape, dtype).
bool read_outs(PyObject* outs, Decision& d) {
  PyObject* seq = PySequence_Fast(outs, "HitPath.put: outs must be a sequence of (shape, dtype)");
  if (seq == nullptr) return false;
  for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); ++k) {
    PyObject *shape, *dtype;
    std::vector<int64_t> dims;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "OO!", &shape, &THPDtypeType, &dtype) ||
        !read_shape(shape, dims)) {
      Py_DECREF(seq);
      return false;
    }
    d.outs.emplace_back(std::move(dims), reinterpret_cast<THPDtype*>(dtype)->scalar_type);
  }
  Py_DECREF(seq);
  d.dps = true;
  return true;
}

size_t cell_of(Core& core, PyObject* state, int kind) {
  for (size_t i = 0; i < core.cells.size(); ++i)
    if (core.cells[i].state == state && core.cells[i].kind == kind) return i;
  Py_INCREF(state);
  core.cells.push_back({state, kind, 0});
  return core.cells.size() - 1;
}

// put(shapes, kind, fn, state, outs=None): calls whose tensor inputs have these shapes call fn
// (HIT, BUCKETED) or the fallback (MISS); with outs, fn is destination-passing.
PyObject* hitpath_put(PyObject* self_, PyObject* args) {
  Core& core = *reinterpret_cast<HitPath*>(self_)->core;
  PyObject *shapes, *fn, *state, *outs = Py_None;
  int kind;
  if (!PyArg_ParseTuple(args, "OiOO|O", &shapes, &kind, &fn, &state, &outs)) return nullptr;
  if (kind != HIT && kind != BUCKETED && kind != MISS) return PyErr_Format(PyExc_ValueError, "HitPath.put: kind %d", kind);
  Signature key;
  if (!encode(core, shapes, key)) return nullptr;
  auto d = std::make_shared<Decision>();
  d->kind = kind;
  if (kind != MISS) {
    if (outs != Py_None && !read_outs(outs, *d)) return nullptr;
    d->fn = fn;
    Py_INCREF(fn);
  }
  d->state = kind == MISS ? Py_None : state;
  Py_INCREF(d->state);
  d->cell = cell_of(core, d->state, kind);
  core.decisions.insert_or_assign(std::move(key), std::move(d));
  Py_RETURN_NONE;
}

void clear_decisions(Core& core) {
  auto old = std::move(core.decisions);  // empty before any DECREF can run Python code
  core.decisions.clear();
}

PyObject* hitpath_clear(PyObject* self_, PyObject*) {
  clear_decisions(*reinterpret_cast<HitPath*>(self_)->core);
  Py_RETURN_NONE;
}

// drain() -> [(state, kind, calls)]: what was served since the last drain, counters reset.
PyObject* hitpath_drain(PyObject* self_, PyObject*) {
  Core& core = *reinterpret_cast<HitPath*>(self_)->core;
  PyObject* out = PyList_New(0);
  if (out == nullptr) return nullptr;
  for (Cell& c : core.cells) {
    if (c.calls == 0) continue;
    PyObject* row = Py_BuildValue("(OiK)", c.state, c.kind, c.calls);
    if (row == nullptr || PyList_Append(out, row) != 0) {
      Py_XDECREF(row);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(row);
    c.calls = 0;
  }
  return out;
}

PyObject* hitpath_size(PyObject* self_, PyObject*) {
  return PyLong_FromSize_t(reinterpret_cast<HitPath*>(self_)->core->decisions.size());
}

// -- type plumbing ---------------------------------------------------------------------------

// HitPath(slow, on_error, normalize, n_in, guards: [(position, dtype)], cuda: bool, single_output: bool)
int hitpath_init(PyObject* self_, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<HitPath*>(self_);
  PyObject *slow, *on_error, *normalize, *guards;
  Py_ssize_t n_in;
  int cuda, single_output;
  static const char* names[] = {"slow", "on_error", "normalize", "n_in", "guards", "cuda", "single_output", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOnOpp", const_cast<char**>(names), &slow, &on_error,
                                   &normalize, &n_in, &guards, &cuda, &single_output))
    return -1;
  Core& core = *self->core;
  core.guards.clear();
  PyObject* seq = PySequence_Fast(guards, "HitPath: guards must be a sequence of (position, dtype)");
  if (seq == nullptr) return -1;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    Py_ssize_t pos;
    PyObject* dtype;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nO!", &pos, &THPDtypeType, &dtype)) {
      Py_DECREF(seq);
      return -1;
    }
    if (pos < 0 || pos >= n_in) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_ValueError, "HitPath: guard position %zd outside the %zd inputs", pos, n_in);
      return -1;
    }
    core.guards.emplace_back(pos, reinterpret_cast<THPDtype*>(dtype)->scalar_type);
  }
  Py_DECREF(seq);
  core.n_in = n_in;
  core.device = cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  core.single_output = single_output;
  Py_INCREF(slow);
  Py_INCREF(on_error);
  Py_INCREF(normalize);
  Py_XSETREF(self->slow, slow);
  Py_XSETREF(self->on_error, on_error);
  Py_XSETREF(self->normalize, normalize);
  return 0;
}

PyObject* hitpath_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<HitPath*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->vectorcall = hitpath_call;
  self->core = new (std::nothrow) Core();
  if (self->core == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

int hitpath_traverse(PyObject* self_, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<HitPath*>(self_);
  Py_VISIT(self->slow);
  Py_VISIT(self->on_error);
  Py_VISIT(self->normalize);
  if (self->core != nullptr) {
    for (auto& [key, d] : self->core->decisions) {
      Py_VISIT(d->fn);
      Py_VISIT(d->state);
    }
    for (Cell& c : self->core->cells) Py_VISIT(c.state);
  }
  return 0;
}

int hitpath_gc_clear(PyObject* self_) {
  auto* self = reinterpret_cast<HitPath*>(self_);
  Py_CLEAR(self->slow);
  Py_CLEAR(self->on_error);
  Py_CLEAR(self->normalize);
  if (self->core != nullptr) {
    clear_decisions(*self->core);
    auto cells = std::move(self->core->cells);
    self->core->cells.clear();
    for (Cell& c : cells) Py_DECREF(c.state);
  }
  return 0;
}

void hitpath_dealloc(PyObject* self_) {
  PyObject_GC_UnTrack(self_);
  hitpath_gc_clear(self_);
  auto* self = reinterpret_cast<HitPath*>(self_);
  delete self->core;
  Py_TYPE(self_)->tp_free(self_);
}

PyMethodDef hitpath_methods[] = {
    {"put", hitpath_put, METH_VARARGS, "put(shapes, kind, fn, state, outs=None): remember a decision for these input shapes."},
    {"clear", hitpath_clear, METH_NOARGS, "clear(): forget every decision (the counters stay)."},
    {"drain", hitpath_drain, METH_NOARGS, "drain() -> [(state, kind, calls)] served since the last drain."},
    {"size", hitpath_size, METH_NOARGS, "size() -> number of remembered signatures."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject HitPathType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_fibray_hitpath", "fibray.apply's compiled hit path.", -1};

}  // namespace

PyMODINIT_FUNC PyInit__fibray_hitpath() {
  HitPathType.tp_name = "_fibray_hitpath.HitPath";
  HitPathType.tp_basicsize = sizeof(HitPath);
  HitPathType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL;
  HitPathType.tp_doc = "HitPath(slow, on_error, normalize, n_in, guards, cuda, single_output)";
  HitPathType.tp_new = hitpath_new;
  HitPathType.tp_init = hitpath_init;
  HitPathType.tp_dealloc = hitpath_dealloc;
  HitPathType.tp_traverse = hitpath_traverse;
  HitPathType.tp_clear = hitpath_gc_clear;
  HitPathType.tp_call = PyVectorcall_Call;
  HitPathType.tp_vectorcall_offset = offsetof(HitPath, vectorcall);
  HitPathType.tp_methods = hitpath_methods;
  if (PyType_Ready(&HitPathType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(&HitPathType);
  if (PyModule_AddObject(module, "HitPath", reinterpret_cast<PyObject*>(&HitPathType)) < 0) {
    Py_DECREF(&HitPathType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
