// The curvature engine: a block as a small graph of nodes, and the passes every derivative is made
// of (docs/derivation.md §4-5).
//
// Values are token-major arrays (B*L rows, one width each). A node reads values, writes one, and
// may own parameters. It implements, once, everything the engine asks of it:
//   forward      its output (and the caches its derivatives need);
//   vjp          the cotangent of its output carried to its inputs, and its parameters' gradients;
//   push         its output's per-token tangent factors from its inputs' (factor.hpp); its own
//                parameters enter there;
//   curvature    its sites and bilinear terms (terms.hpp), given the reverse pass's cotangents;
//   jvp          the tangent of its output for the tangent of its inputs and parameters;
//   vjp_tangent  the tangent of its vjp (the Hessian-vector product's reverse pass): the cotangent's
//                tangent carried back, plus (curved) its Jacobian's own tangent applied to the
//                cotangent: the same second derivatives curvature() emits, applied to a vector.
// A wiring (blocks/) adds the nodes in order; the engine runs the passes over them. The block's
// math lives in the nodes; nothing here knows what a LayerNorm or an attention head is.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "blockhess/backend_buffer.hpp"
#include "blockhess/buffer.hpp"
#include "blockhess/config.hpp"
#include "blockhess/cpu_backend.hpp"
#include "blockhess/engine/rows/entries.hpp"
#include "blockhess/engine/factor.hpp"
#include "blockhess/engine/terms.hpp"
#include "blockhess/finite.hpp"

namespace blockhess::engine {

template <class T>
class Graph;

// How a graph holds its parameters: a copy of its own (it may outlive the caller's arrays), or
// borrowed, the caller's arrays read in place where they are aligned like a copy would be (the
// caller keeps them alive and unchanged while the graph lives: one call). Either way the results
// are the same bits.
enum class Storage { copy, borrow };

// What Graph::require_host throws: a part of the engine that still runs on the host, asked of a
// backend whose memory the host cannot address (a caller may then run the call on host copies).
class RunsOnHost : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A parameter, or one block of its columns, with its own tangent factors (factor.hpp).
struct Piece {
  int param = -1;
  index_t col_offset = 0, cols = 0;
};

// Where a node writes its share of a value's cotangent: assigned by the first node, added by the rest.
template <class T>
struct Slot {
  T* data = nullptr;
  bool add = false;
};

// A slot of `data` (none where null), claimed by a node: the first claim since `written` was
// cleared assigns, the later ones add (a value's cotangent shares, a shared parameter's gradient).
template <class T>
Slot<T> claim_slot(T* data, char& written) {
  if (!data) return {};
  const bool add = written != 0;
  written = 1;
  return {data, add};
}

// The tangents of one Hessian-vector product in flight, in the graph's backend's memory. Kept and
// reused between products (the buffers keep their size), one per product running at once.
// Uninitialised storage: each node writes a tangent (or the first share of a slot) before anything
// reads it.
template <class T>
struct Tangent {
  const Backend<T>* backend = nullptr;   // the graph's (Graph::start)
  std::vector<BackendBuffer<T>> d;       // per value: its forward tangent (where has_d)
  std::vector<BackendBuffer<T>> dcot;    // per value: the tangent of its cotangent
  std::vector<char> has_d, dcot_written;
  std::vector<const T*> dW;      // per parameter: its tangent (inside v), null when not selected
  std::vector<T*> dgrad;         // per parameter: its rows of H v, null when not selected
  std::vector<char> dgrad_written;  // per parameter: a node has written its share (Graph::gradient_slot)
  std::vector<std::deque<BackendBuffer<T>>> node_scratch;  // a deque: growing it keeps references valid

  // Node scratch k, of `size` values, uninitialised: the node writes it before reading it.
  BackendBuffer<T>& scratch(int node, int k, index_t size) {
    auto& list = node_scratch[static_cast<size_t>(node)];
    if (static_cast<int>(list.size()) <= k) list.resize(static_cast<size_t>(k + 1));
    BackendBuffer<T>& b = list[static_cast<size_t>(k)];
    b.resize(*backend, size);
    return b;
  }
  // The tangent of value v, sized for writing (marks it present).
  T* out(int v, index_t size) {
    has_d[static_cast<size_t>(v)] = 1;
    d[static_cast<size_t>(v)].resize(*backend, size);
    return d[static_cast<size_t>(v)].data();
  }
  const T* in(int v) const { return has_d[static_cast<size_t>(v)] ? d[static_cast<size_t>(v)].data() : nullptr; }
  // A shared parameter's rows of H v (a parameter several nodes use): the first node assigns, the
  // rest add. Null data where it is not selected.
  Slot<T> dgrad_slot(int p) { return claim_slot(dgrad[static_cast<size_t>(p)], dgrad_written[static_cast<size_t>(p)]); }
  Slot<T> dcot_slot(int v, index_t size) {
    BackendBuffer<T>& b = dcot[static_cast<size_t>(v)];
    b.resize(*backend, size);
    return claim_slot(b.data(), dcot_written[static_cast<size_t>(v)]);
  }
};

// A weight applied to every token, out_t = in_t W (+ b): its inputs' rows (tokens, rows of W) and,
// after a reverse pass, its outputs' cotangent rows (tokens, columns of W); for the bias b the same
// cotangents and inputs null (a bias is a weight whose input is 1); for a table looked up by id (an
// embedding's rows, learned positions, a class token) ids instead of inputs, token t's input the
// one-hot of ids[t] (none where -1); transposed for a weight applied as out_t = in_t W^T (a tied LM
// head), its inputs then (tokens, columns of W) and its cotangents (tokens, rows); all null where
// the parameter is not used so. What methods that factor a weight's curvature by its two sides read
// (kfac.hpp).
template <class T>
struct LinearUse {
  const T* inputs = nullptr;
  const T* cotangents = nullptr;
  const std::int64_t* ids = nullptr;
  bool transposed = false;
};

// A node's working memory in elements beside the values, cotangents and tangents the graph holds
// for it (engine/working_memory.hpp): what forward() keeps, what vjp() keeps, one Hessian-vector
// product's scratch (Tangent::scratch), and its curvature terms' buffers (a site's Omegas).
struct Footprint {
  index_t forward = 0, reverse = 0, tangent = 0, curvature = 0;
};

template <class T>
class Node {
 public:
  virtual ~Node() = default;
  std::vector<int> inputs;
  int output = -1;
  int index = -1;           // position in the graph (its scratch in a Tangent)
  std::vector<int> params;  // the parameters it owns

  virtual void forward(Graph<T>& g) = 0;
  virtual void vjp(Graph<T>& g) const = 0;
  virtual void push(Graph<T>& g) const = 0;
  virtual void curvature(const Graph<T>& g, Terms<T>& terms) const = 0;
  virtual void jvp(const Graph<T>& g, Tangent<T>& tg) const = 0;
  virtual void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool curved) const = 0;
  // Whether its parameters' factors are pushed alike (an attention head's all move its rows of the
  // output; a linear weight and its bias both enter as the identity), so that they are best
  // formed together: Graph::factor_groups.
  virtual bool parameters_move_alike() const { return true; }
  // Token-local with one input, and no parameter that carries factors: a site at its output is the
  // site J_t^T Omega_t J_t at its input (every factor at the output is J_t times one at the input).
  virtual bool pulls_sites() const { return false; }
  // Whether row t of its output depends on row t of its inputs alone (no mixing of tokens): a
  // factor stays the same per-token map through it (Graph::token_local_cuts).
  virtual bool token_local() const { return false; }
  // Where the node applies parameter p (one of its own) to every token as a weight: LinearUse.
  virtual LinearUse<T> linear_use(const Graph<T>& /*g*/, int /*p*/) const { return {}; }
  virtual void pull_site(const Graph<T>&, index_t /*t*/, const T* /*omega_out*/, T* /*omega_in*/) const {}

  // What the engine's working-memory estimate reads (engine/working_memory.hpp); each node states
  // the buffers its own passes allocate, where they allocate them. The defaults: none.
  virtual Footprint footprint(const Graph<T>& /*g*/) const { return {}; }
  // The columns of the tangent factors its parameters push (their G_t, factor.hpp), and what
  // parameter p's factor brings where it enters (its vec and any fixed right factor R_t).
  virtual index_t factor_columns(const Graph<T>& g) const;
  virtual index_t entering_factor(const Graph<T>& g, int p) const;
  // What a factor of r columns from below costs passing through it beside its G_t at the output
  // (attention's mix(): the factor's slabs at Q, K, V and the logits).
  virtual index_t passing_factor(const Graph<T>& /*g*/, index_t /*r*/) const { return 0; }
  // What its push allocates only while it runs, for every factor passing it at once, when they have
  // at most r columns (a norm's Jacobians): counted once, not once a factor.
  virtual index_t push_scratch(const Graph<T>& /*g*/, index_t /*r*/) const { return 0; }
};

template <class T>
class Graph {
 public:
  struct Param {
    std::string name;
    index_t rows = 0, cols = 0;
    BackendBuffer<T> data;        // a copy, unless borrowed
    const T* borrowed = nullptr;  // the caller's array, read in place
    index_t size() const { return rows * cols; }
    const T* values() const { return borrowed ? borrowed : data.data(); }
  };

  // A graph of B samples of L tokens whose work runs on `backend` (backend.hpp), which must outlive
  // it, in its memory: the input, the parameters and every value, cotangent and tangent.
  explicit Graph(index_t B, index_t L, const Backend<T>& backend = cpu_backend<T>())
      : B_(B), L_(L), backend_(&backend) {}
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  const Backend<T>& backend() const { return *backend_; }
  // Refuses (RunsOnHost) a backend whose memory the host cannot address for `what`, a part of the
  // engine that still runs on the host (docs/backends.md).
  void require_host(const char* what) const {
    if (!backend_->host_addressable())
      throw RunsOnHost(std::string("engine: ") + what + " runs on the host so far; on this backend the "
                                  "forward pass, the loss, its gradient, Hessian-vector products and the factors of "
                                  "linear and pointwise maps, norms and attentions run "
                                  "(docs/backends.md)");
  }
  index_t samples() const { return B_; }
  index_t tokens_per_sample() const { return L_; }
  index_t tokens() const { return B_ * L_; }

  // ---- building (a wiring) ----
  // X null: a graph wired for its shapes only (a working-memory estimate, working_memory.hpp),
  // whose passes never run.
  int input(const T* X, index_t width) {
    const int v = new_value(width, -1, false);
    if (X) copy(X, value_out(v), tokens() * width);
    return v;
  }
  int param(std::string name, index_t rows, index_t cols, const T* data, Storage storage = Storage::copy) {
    // Borrowed only where aligned like Buffer's copy: Eigen's kernels then read the same bits in
    // the same order (buffer.hpp), and a 720,896-parameter block skips copying 2.9 MB per call.
    constexpr std::uintptr_t copy_alignment = EIGEN_DEFAULT_ALIGN_BYTES > 0 ? EIGEN_DEFAULT_ALIGN_BYTES : 1;
    const bool in_place = storage == Storage::borrow && reinterpret_cast<std::uintptr_t>(data) % copy_alignment == 0;
    if (in_place) {
      params_.push_back(Param{std::move(name), rows, cols, BackendBuffer<T>(), data});
    } else {
      params_.push_back(Param{std::move(name), rows, cols, BackendBuffer<T>(*backend_, rows * cols)});
      copy(data, params_.back().data.data(), rows * cols);
    }
    const int p = static_cast<int>(params_.size()) - 1;
    uses_.push_back(0);
    pieces_of_.push_back({static_cast<int>(pieces_.size())});
    pieces_.push_back(Piece{p, 0, cols});
    return p;
  }
  // Splits a parameter into `parts` equal blocks of columns, each with its own tangent factors
  // (attention heads: each head's columns of W_Q, W_K, W_V reach the output through its own A).
  void split_columns(int p, index_t parts) {
    const index_t cols = parameter(p).cols / parts;
    std::vector<int>& list = pieces_of_[static_cast<size_t>(p)];
    pieces_[static_cast<size_t>(list[0])] = Piece{p, 0, cols};
    list.resize(1);
    for (index_t k = 1; k < parts; ++k) {
      list.push_back(static_cast<int>(pieces_.size()));
      pieces_.push_back(Piece{p, k * cols, cols});
    }
  }
  // Adds a node reading `inputs` and owning `params`; returns the id of its output value. A
  // parameter may be owned by several nodes (a language model's LM head tied to its embedding):
  // each of them then writes its gradient through gradient_slot and its rows of H v through
  // Tangent::dgrad_slot, which sum its uses.
  int add(std::unique_ptr<Node<T>> node, std::vector<int> inputs, std::vector<int> params, index_t out_width) {
    for (int p : params) ++uses_[static_cast<size_t>(p)];
    bool varies = !params.empty();
    for (int v : inputs) varies = varies || varies_[static_cast<size_t>(v)];
    node->inputs = std::move(inputs);
    node->params = std::move(params);
    node->index = static_cast<int>(nodes_.size());
    node->output = new_value(out_width, node->index, varies);
    nodes_.push_back(std::move(node));
    return nodes_.back()->output;
  }
  void set_output(int v) { output_ = v; }
  // A value whose cotangent every reverse pass checks, named in the error (a stage of the wiring).
  void check_cotangent(int v, std::string stage) { checked_.emplace_back(v, std::move(stage)); }

  // ---- what the nodes read and write ----
  int output() const { return output_; }
  int num_values() const { return static_cast<int>(width_.size()); }
  int num_params() const { return static_cast<int>(params_.size()); }
  int num_pieces() const { return static_cast<int>(pieces_.size()); }
  const std::vector<std::unique_ptr<Node<T>>>& nodes() const { return nodes_; }
  const Piece& piece(int f) const { return pieces_[static_cast<size_t>(f)]; }
  const std::vector<int>& pieces_of(int p) const { return pieces_of_[static_cast<size_t>(p)]; }
  int whole(int p) const {  // the one piece of an unsplit parameter
    const std::vector<int>& list = pieces_of(p);
    if (list.size() != 1) throw std::logic_error("engine: parameter " + parameter(p).name + " is split into pieces");
    return list[0];
  }
  // Where a factor of piece f sits in its parameter: the Split of a block of columns.
  kron::Split split_of(int f, bool vec_on_first) const {
    const Piece& pc = piece(f);
    return kron::Split{parameter(pc.param).rows, pc.cols, vec_on_first, parameter(pc.param).cols, pc.col_offset};
  }
  const Param& parameter(int p) const { return params_[static_cast<size_t>(p)]; }
  const T* weight(int p) const { return params_[static_cast<size_t>(p)].values(); }
  index_t width(int v) const { return width_[static_cast<size_t>(v)]; }
  bool varies(int v) const { return varies_[static_cast<size_t>(v)]; }
  const Node<T>* producer(int v) const {
    const int n = producer_[static_cast<size_t>(v)];
    return n < 0 ? nullptr : nodes_[static_cast<size_t>(n)].get();
  }
  const T* value(int v) const { return values_[static_cast<size_t>(v)].data(); }
  // to = from, n values in the backend's memory.
  void copy(const T* from, T* to, index_t n) const { backend_->run(rows::WriteEntries<T>{from, to, false}, n); }
  // A copy of value v in the backend's memory: the vectors of a factor that enters at it (factor.hpp).
  SharedArray<T> value_copy(int v) const {
    BackendBuffer<T> x(*backend_, tokens() * width(v));
    copy(value(v), x.data(), tokens() * width(v));
    return shared_array(std::move(x));
  }
  T* value_out(int v) {  // sized for the node that writes it, uninitialised
    BackendBuffer<T>& b = values_[static_cast<size_t>(v)];
    b.resize(*backend_, tokens() * width(v));
    return b.data();
  }
  const T* cotangent(int v) const { return cot_[static_cast<size_t>(v)].data(); }
  Slot<T> cotangent_slot(int v) {
    BackendBuffer<T>& b = cot_[static_cast<size_t>(v)];
    b.resize(*backend_, tokens() * width(v));
    return claim_slot(b.data(), cot_written_[static_cast<size_t>(v)]);
  }
  // Where a node writes (assigns) the gradient of a parameter it alone uses; null where not wanted.
  T* gradient_out(int p) const {
    if (uses_[static_cast<size_t>(p)] > 1)
      throw std::logic_error("engine: " + parameter(p).name + " is shared: write its gradient through gradient_slot");
    return grad_out_[static_cast<size_t>(p)];
  }
  // The gradient of a parameter several nodes use: the first to write assigns, the rest add.
  Slot<T> gradient_slot(int p) {
    return claim_slot(grad_out_[static_cast<size_t>(p)], grad_written_[static_cast<size_t>(p)]);
  }
  bool selected(int p) const { return selected_[static_cast<size_t>(p)] != 0; }
  bool piece_selected(int f) const { return selected(piece(f).param); }
  // Factors are kept per piece (f); an unsplit parameter p has the one piece whole(p).
  const Factor<T>& factor(int v, int p) const { return factors_[static_cast<size_t>(v)][static_cast<size_t>(p)]; }
  void set_factor(int v, int p, Factor<T> f) { factors_[static_cast<size_t>(v)][static_cast<size_t>(p)] = std::move(f); }
  std::vector<const Factor<T>*> factors(int v) const {
    std::vector<const Factor<T>*> all;
    for (const Factor<T>& f : factors_[static_cast<size_t>(v)]) all.push_back(&f);
    return all;
  }
  void set_factors(int v, std::vector<Factor<T>> fs) {
    for (size_t p = 0; p < fs.size(); ++p)
      if (fs[p].present) factors_[static_cast<size_t>(v)][p] = std::move(fs[p]);
  }

  // ---- the passes ----
  void forward() {
    for (auto& node : nodes_) node->forward(*this);
  }

  // Cotangents of every varying value for the cotangent g_output of the output, and (where
  // gradient[p] is not null) the gradient of each parameter.
  void reverse(const T* g_output, std::vector<T*> gradient = {}) {
    gradient.resize(params_.size(), nullptr);
    grad_out_ = std::move(gradient);
    grad_written_.assign(params_.size(), 0);
    std::fill(cot_written_.begin(), cot_written_.end(), 0);
    Slot<T> seed = cotangent_slot(output_);
    copy(g_output, seed.data, tokens() * width(output_));
    for (auto it = nodes_.rbegin(); it != nodes_.rend(); ++it)
      if (varies((*it)->output)) (*it)->vjp(*this);
    for (const auto& [v, stage] : checked_) require_finite(backend(), cotangent(v), tokens() * width(v), stage);
  }

  // Where parameter p is a weight (or its bias) applied to every token (Node::linear_use), by its
  // owner; a shared parameter's use as a matrix applied to its inputs where it has one such use
  // and other uses by lookup (a tied embedding's use as the LM head's weight), else none.
  LinearUse<T> linear_use(int p) const {
    require_host("a weight's two sides (linear_use)");
    std::vector<LinearUse<T>> uses;
    for (const auto& node : nodes_)
      for (int q : node->params)
        if (q == p) uses.push_back(node->linear_use(*this, p));
    if (uses.size() == 1) return uses[0];
    const auto applied = [](const LinearUse<T>& u) { return u.inputs != nullptr; };
    const auto looked_up = [](const LinearUse<T>& u) { return u.ids != nullptr; };
    if (std::count_if(uses.begin(), uses.end(), applied) == 1 &&
        std::count_if(uses.begin(), uses.end(), looked_up) == static_cast<std::ptrdiff_t>(uses.size()) - 1)
      return *std::find_if(uses.begin(), uses.end(), applied);
    return {};
  }

  // The parameters whose factors are best formed together: a node's, or each of them alone where
  // they move differently (Node::parameters_move_alike).
  std::vector<std::vector<int>> factor_groups() const {
    std::vector<std::vector<int>> groups;
    for (const auto& node : nodes_) {
      if (node->params.empty()) continue;
      if (node->parameters_move_alike()) groups.push_back(node->params);
      else
        for (int p : node->params) groups.push_back({p});
    }
    return groups;
  }

  // The parameters the Hessian is taken with respect to (one flag per parameter).
  void select(const std::vector<bool>& selection) {
    require_one_flag_each(selection);
    selected_.assign(selection.begin(), selection.end());
  }

  // Where each parameter sits in the flattened vector of the ones `selection` flags, in the graph's
  // order (one not flagged: where the next flagged one would); *total: their size.
  std::vector<index_t> offsets(const std::vector<bool>& selection, index_t* total = nullptr) const {
    require_one_flag_each(selection);
    std::vector<index_t> off(params_.size(), 0);
    index_t size = 0;
    for (size_t p = 0; p < params_.size(); ++p) {
      off[p] = size;
      if (selection[p]) size += params_[p].size();
    }
    if (total) *total = size;
    return off;
  }

  // The tangent factors of the selected parameters at every value, up to the output's producer's
  // input (to_output: at the output too; sites at the output are pulled back instead).
  // The pushes of a linear map, a pointwise map, a sum and a norm run on any backend; an
  // attention's and the LM head's refuse a backend the host cannot address (docs/backends.md).
  void push_factors(bool to_output) {
    fresh_factors();
    push_nodes(0, to_output);
  }

  // The nodes k after which every node is token-local and reads only k's output or a later node's
  // (and parameters): a parameter of a node up to k moves every later value through k's output
  // alone, token by token (diagonal.hpp's site at a cut). In order; never the last node.
  std::vector<int> token_local_cuts() const {
    std::vector<int> cuts;
    const int n = static_cast<int>(nodes_.size());
    for (int k = 0; k + 1 < n; ++k) {
      bool cut = true;
      for (int m = k + 1; m < n && cut; ++m) {
        cut = nodes_[static_cast<size_t>(m)]->token_local();
        for (int v : nodes_[static_cast<size_t>(m)]->inputs)
          cut = cut && (v == nodes_[static_cast<size_t>(k)]->output || producer_[static_cast<size_t>(v)] > k);
      }
      if (cut) cuts.push_back(k);
    }
    return cuts;
  }

  // The cuts a diagonal over `selection` takes, each group to the first at or after its parameters'
  // last use: a cut's site costs about one push of a factor as wide as its value through the nodes
  // above it and saves the groups below it theirs, so it is taken where those groups' factors have
  // at least twice its columns (an attention alone, as wide as the cut, pushes as much as the probe).
  std::vector<int> token_local_cuts(const std::vector<bool>& selection) const {
    require_one_flag_each(selection);
    const std::vector<int> cuts = token_local_cuts();
    std::map<int, index_t> columns;  // a cut's groups' factor columns
    for (const auto& node : nodes_) {
      int last = -1, groups = 0;
      for (int p : node->params)
        if (selection[static_cast<size_t>(p)]) last = std::max(last, last_use(p)), ++groups;
      const int cut = cut_at_or_after(cuts, last);
      if (last < 0 || cut < 0) continue;
      columns[cut] += node->factor_columns(*this) * (node->parameters_move_alike() ? 1 : groups);
    }
    std::vector<int> taken;
    for (const auto& [cut, r] : columns)
      if (r >= 2 * width(nodes_[static_cast<size_t>(cut)]->output)) taken.push_back(cut);
    return taken;
  }

  // The first of `cuts` (in order) at or after node `last`, the last to use a group's parameters:
  // where that group's factors stop; -1 where none is.
  static int cut_at_or_after(const std::vector<int>& cuts, int last) {
    const auto at = std::lower_bound(cuts.begin(), cuts.end(), last);
    return at == cuts.end() ? -1 : *at;
  }

  // push_factors(false) in two parts around a cut: through the nodes up to `last` from no factors
  // (nothing above it moves), then through the nodes after it onto the factors already there.
  void push_factors_through(int last) {
    fresh_factors();
    for (int k = 0; k <= last; ++k) nodes_[static_cast<size_t>(k)]->push(*this);
  }
  void push_factors_after(int last) { push_nodes(last + 1, false); }

  // The last node that uses parameter p.
  int last_use(int p) const {
    int last = -1;
    for (const auto& node : nodes_)
      if (std::find(node->params.begin(), node->params.end(), p) != node->params.end()) last = node->index;
    return last;
  }

  // Drops every value's factors (after a push that a node declined: FactorsDoNotReach).
  void clear_factors() {
    for (auto& per_value : factors_) per_value.clear();
  }

  // Every node's curvature (the functional part of the Hessian of the scalar behind reverse()), over
  // the selected parameters: a node that none of them moves (through an input or a parameter of its
  // own) adds nothing, since each of its terms is bilinear in those differentials, and is skipped
  // (a lower block's LayerNorm sites, say, when the selection is a higher block's).
  // Up to node `last` only, where given (the nodes after a cut bring their sites there instead).
  Terms<T> curvature(int last = std::numeric_limits<int>::max()) const {
    require_host("the nodes' curvature terms");
    Terms<T> terms;
    std::vector<char> moved(width_.size(), 0);
    for (auto& node : nodes_) {
      if (node->index > last) break;
      bool m = false;
      for (int p : node->params) m = m || selected(p);
      for (int v : node->inputs) m = m || moved[static_cast<size_t>(v)];
      moved[static_cast<size_t>(node->output)] = m;
      if (m) node->curvature(*this, terms);
    }
    return terms;
  }

  // The curvature of the nodes after `last` (with nothing selected: their sites, which diagonal.hpp
  // settles at a cut).
  Terms<T> curvature_after(int last) const {
    require_host("the nodes' curvature terms");
    Terms<T> terms;
    for (const auto& node : nodes_)
      if (node->index > last && varies(node->output)) node->curvature(*this, terms);
    return terms;
  }

  // One Hessian-vector product's tangents: forward, then the reverse pass's tangent from the seed
  // dcot(output) (seed(dZ, dgZ) writes it; null = zero: the functional part alone). curved: add
  // each node's second derivatives (the functional part). v and out hold the selected parameters.
  template <class Seed>
  void hvp(Tangent<T>& tg, const std::vector<index_t>& offset, const T* v, Seed&& seed, bool curved, T* out) const {
    start(tg);
    for (size_t p = 0; p < params_.size(); ++p)
      if (selected_[p]) tg.dW[p] = v + offset[p], tg.dgrad[p] = out + offset[p];
    for (auto& node : nodes_) node->jvp(*this, tg);
    const index_t n_out = tokens() * width(output_);
    if (!tg.in(output_)) return;  // nothing selected reaches the output
    Slot<T> s = tg.dcot_slot(output_, n_out);
    if (!seed(tg.in(output_), s.data)) backend_->run(rows::Zero<T>{s.data}, n_out);
    for (auto it = nodes_.rbegin(); it != nodes_.rend(); ++it)
      if (tg.in((*it)->output)) (*it)->vjp_tangent(*this, tg, curved);
  }

  // The forward tangent of every value for the tangent dW of parameter p alone: returns the output's
  // tangent, or null where p does not reach it.
  const T* jvp_parameter(Tangent<T>& tg, int p, const T* dW) const {
    start(tg);
    tg.dW.at(static_cast<size_t>(p)) = dW;
    for (auto& node : nodes_) node->jvp(*this, tg);
    return tg.in(output_);
  }

  // The forward tangent of every value for the tangent dX of the input value x, no parameter
  // moving (the forward half of hvp): returns the output's tangent, or null where x does not reach it.
  const T* jvp_input(Tangent<T>& tg, int x, const T* dX) const {
    start(tg);
    const index_t n = tokens() * width(x);
    copy(dX, tg.out(x, n), n);
    for (auto& node : nodes_) node->jvp(*this, tg);
    return tg.in(output_);
  }

 private:
  void fresh_factors() {
    for (auto& per_value : factors_) per_value.assign(pieces_.size(), Factor<T>{});
  }
  // Pushes the nodes from `first` on (to_output: as push_factors).
  void push_nodes(int first, bool to_output) {
    for (auto& node : nodes_) {
      if (node->index < first || (!to_output && node->output == output_ && node->pulls_sites())) continue;
      node->push(*this);
    }
  }

  void require_one_flag_each(const std::vector<bool>& selection) const {
    if (selection.size() != params_.size())
      throw std::invalid_argument("engine: wrt needs one flag per parameter (" + std::to_string(params_.size()) +
                                  "), got " + std::to_string(selection.size()));
  }

  // A Tangent with no value moving yet and no parameter selected.
  void start(Tangent<T>& tg) const {
    const size_t nv = width_.size(), np = params_.size();
    tg.backend = backend_;
    tg.d.resize(nv), tg.dcot.resize(nv), tg.node_scratch.resize(nodes_.size());
    tg.has_d.assign(nv, 0), tg.dcot_written.assign(nv, 0);
    tg.dW.assign(np, nullptr), tg.dgrad.assign(np, nullptr), tg.dgrad_written.assign(np, 0);
  }

  int new_value(index_t width, int producer, bool varies) {
    width_.push_back(width);
    producer_.push_back(producer);
    varies_.push_back(varies);
    values_.emplace_back();
    cot_.emplace_back();
    cot_written_.push_back(0);
    factors_.emplace_back();
    return static_cast<int>(width_.size()) - 1;
  }

  index_t B_, L_;
  const Backend<T>* backend_;
  std::vector<Param> params_;
  std::vector<Piece> pieces_;
  std::vector<std::vector<int>> pieces_of_;
  std::vector<std::unique_ptr<Node<T>>> nodes_;
  std::vector<index_t> width_;
  std::vector<int> producer_;
  std::vector<bool> varies_;
  std::vector<BackendBuffer<T>> values_;
  std::vector<BackendBuffer<T>> cot_;  // written by the first share of each slot
  std::vector<char> cot_written_;
  std::vector<T*> grad_out_;
  std::vector<char> grad_written_;  // per parameter: a node has written its share (gradient_slot)
  std::vector<int> uses_;           // per parameter: the nodes that own it
  std::vector<char> selected_;
  std::vector<std::vector<Factor<T>>> factors_;
  std::vector<std::pair<int, std::string>> checked_;
  int output_ = -1;
};

// By default a parameter's factor carries at most as many columns as its longer side, and brings
// its vec and a Gamma diagonal where it enters.
template <class T>
index_t Node<T>::factor_columns(const Graph<T>& g) const {
  index_t r = 0;
  for (int p : params) r = std::max({r, g.parameter(p).rows, g.parameter(p).cols});
  return r;
}
template <class T>
index_t Node<T>::entering_factor(const Graph<T>& g, int p) const {
  return g.tokens() * (g.parameter(p).rows + g.parameter(p).cols);
}

// out = the sums over g's tokens of a (tokens, cols), or of a * times entry by entry, assigned or
// (accumulate) added, on g's backend: a bias's or gamma's gradient.
template <class T>
void token_sums(const Graph<T>& g, const T* a, index_t cols, T* out, const T* times = nullptr, bool accumulate = false) {
  g.backend().run(rows::ColumnSums<T>{a, times, out, g.tokens(), cols, accumulate}, cols);
}

// Writes the values of a node's share of a cotangent (or any accumulated quantity) into a slot, on
// g's backend.
template <class T>
void write_slot(const Graph<T>& g, const Slot<T>& slot, const T* values, index_t n) {
  g.backend().run(rows::WriteEntries<T>{values, slot.data, slot.add}, n);
}

}  // namespace blockhess::engine
