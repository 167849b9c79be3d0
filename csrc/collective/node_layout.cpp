#include "collective/node_layout.hpp"

#include <map>
#include <sstream>

#include "collective/rank_list.hpp"

namespace sdma {

NodeLayout NodeLayout::group(const std::vector<std::string>& nodeOfRank) {
  NodeLayout layout;
  std::map<std::string, int> index;
  for (size_t q = 0; q < nodeOfRank.size(); ++q) {
    auto [it, added] = index.emplace(nodeOfRank[q], static_cast<int>(layout.nodes_.size()));
    if (added) {
      layout.nodes_.emplace_back();
    }
    layout.nodeOf_.push_back(it->second);
    layout.localOf_.push_back(static_cast<int>(layout.nodes_[it->second].size()));
    layout.nodes_[it->second].push_back(static_cast<int>(q));
  }
  return layout;
}

std::vector<int> NodeLayout::rail(int local) const {
  std::vector<int> ranks;
  for (const auto& n : nodes_) {
    ranks.push_back(n[local]);
  }
  return ranks;
}

bool NodeLayout::equalNodeSizes() const {
  for (const auto& n : nodes_) {
    if (n.size() != nodes_.front().size()) {
      return false;
    }
  }
  return true;
}

std::string NodeLayout::hierarchyProblem() const {
  if (!equalNodeSizes()) {
    return "nodes of unequal size";
  }
  if (ranksPerNode() == 1) {
    return "one rank per node";
  }
  return "";
}

std::string NodeLayout::describe() const {
  std::ostringstream os;
  if (nodes_.empty()) {
    return "no members";
  }
  if (!equalNodeSizes()) {
    os << nodeCount() << " nodes of unequal size (";
    for (int m = 0; m < nodeCount(); ++m) {
      os << (m ? "," : "") << rankList(nodes_[m], ",");
    }
    os << ")";
    return os.str();
  }
  const int per = ranksPerNode();
  os << nodeCount() << (nodeCount() == 1 ? " node x " : " nodes x ") << per << (per == 1 ? " rank" : " ranks")
     << " (rails ";
  for (int r = 0; r < per; ++r) {
    os << (r ? "," : "") << rankList(rail(r), ",");
  }
  os << ")";
  return os.str();
}

}  // namespace sdma
