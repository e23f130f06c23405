// relu, entry by entry: out = max(in, 0), with relu'(0) taken as 0 (the choice of ffn.hpp and of
// torch's backward). Its Jacobian is the 0/1 mask of positive inputs, a diagonal per token; relu''
// is 0 almost everywhere, so it has no curvature of its own. (A smooth activation adds a site,
// diag(g * phi''), here.)
#pragma once

#include "blockhess/engine/graph.hpp"
#include "blockhess/ffn.hpp"

namespace blockhess::engine {

template <class T>
class ReluNode final : public Node<T> {
 public:
  void forward(Graph<T>& g) override {
    const index_t size = g.tokens() * g.width(this->output);
    const T* x = g.value(in());
    T* y = g.value_out(this->output);
    mask_.resize(static_cast<size_t>(size));
    for (index_t k = 0; k < size; ++k) {
      mask_[k] = ffn::relu_grad(x[k]);
      y[k] = x[k] > T(0) ? x[k] : T(0);
    }
  }

  void vjp(Graph<T>& g) const override {
    if (!g.varies(in())) return;
    masked(g.cotangent(this->output), g.cotangent_slot(in()), g.tokens() * g.width(in()));
  }

  void push(Graph<T>& g) const override {
    for (int p = 0; p < g.num_params(); ++p) {
      const Factor<T>& f = g.factor(in(), p);
      if (f.present) g.set_factor(this->output, p, scale_rows(f, g.tokens(), mask_.data()));
    }
  }

  void curvature(const Graph<T>&, Terms<T>&) const override {}

  bool pulls_sites() const override { return true; }
  void pull_site(const Graph<T>& g, index_t t, const T* omega_out, T* omega_in) const override {
    const index_t w = g.width(in());
    const T* m = mask_.data() + t * w;
    for (index_t a = 0; a < w; ++a)
      for (index_t b = 0; b < w; ++b) omega_in[a * w + b] = m[a] * omega_out[a * w + b] * m[b];
  }

  void jvp(const Graph<T>& g, Tangent<T>& tg) const override {
    const T* din = tg.in(in());
    if (!din) return;
    const index_t size = g.tokens() * g.width(in());
    masked(din, Slot<T>{tg.out(this->output, size), false}, size);
  }

  void vjp_tangent(const Graph<T>& g, Tangent<T>& tg, bool) const override {  // relu'' = 0: the mask stays
    if (!tg.in(in())) return;
    const index_t size = g.tokens() * g.width(in());
    masked(tg.dcot[this->output].data(), tg.dcot_slot(in(), size), size);
  }

 private:
  int in() const { return this->inputs[0]; }
  void masked(const T* x, const Slot<T>& slot, index_t size) const {
    for (index_t k = 0; k < size; ++k) {
      const T v = mask_[k] * x[k];
      slot.data[k] = slot.add ? slot.data[k] + v : v;
    }
  }

  Buffer<T> mask_;  // relu'(in), 0 or 1
};

}  // namespace blockhess::engine
